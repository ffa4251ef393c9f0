"""LLaMA-Factory's ``train`` with every training step recorded (tests.helpers.framework_record), for
the framework tests: run under torchrun (``-m tests.helpers.lf_record train CONFIG.yaml``) in the
LLaMA-Factory environment.

Environment: ``RECORD_DIR``, ``KILL_AT=N`` (framework_record), ``TOKENBAL=1`` (tokenbal's
integration; otherwise LLaMA-Factory's own trainer, sampler and collator, ``packing`` /
``neat_packing`` included)."""

from __future__ import annotations

import os
import sys

from tests.helpers.framework_record import kill_callback, recording, start


def _recording(base):
    return recording(base, "llamafactory", lambda trainer: trainer.train_dataset["input_ids"])


def main() -> int:
    import llamafactory.train.sft.workflow as workflow
    import llamafactory.train.tuner as tuner

    start()
    run_exp = tuner.run_exp
    tuner.run_exp = lambda args=None, callbacks=None: run_exp(args, [*(callbacks or []), kill_callback()])
    if os.environ.get("TOKENBAL") == "1":
        from tokenbal.integrations import llamafactory as tb

        make = tb.trainer_class
        tb.trainer_class = lambda base, options: make(_recording(base), options)
        return tb.main(sys.argv[1:])
    workflow.CustomSeq2SeqTrainer = _recording(workflow.CustomSeq2SeqTrainer)
    from llamafactory.cli import main as lf_main

    lf_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
