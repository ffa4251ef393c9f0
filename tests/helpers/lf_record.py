"""LLaMA-Factory's ``train`` with every training step recorded, for tests/frameworks: run under
torchrun (``-m tests.helpers.lf_record train CONFIG.yaml``) in the LLaMA-Factory environment.

Environment: ``RECORD_DIR`` (one ``rank{r}.jsonl`` per rank: step, the dataset rows of the step's
micro-batch, its real and padded token counts), ``TOKENBAL=1`` (tokenbal's integration; otherwise
LLaMA-Factory's own trainer and sampler), ``KILL_AT=N`` (every rank exits hard after step N, as a
killed job would: nothing after the last checkpoint is saved)."""

from __future__ import annotations

import json
import os
import sys


def _recording(base):
    class Recording(base):
        def training_step(self, model, inputs, *args, **kwargs):
            if not hasattr(self, "_row_of"):
                all_ids = self.train_dataset["input_ids"]
                self._row_of = {tuple(ids): i for i, ids in enumerate(all_ids)}
                if int(os.environ.get("RANK", 0)) == 0:   # LF's own lengths beside the planned ones
                    planned = getattr(self, "tokenbal_sampler", None)
                    with open(os.path.join(os.environ["RECORD_DIR"], "lengths.json"), "w") as f:
                        json.dump({"llamafactory": [len(ids) for ids in all_ids],
                                   "tokenbal": None if planned is None else planned.lengths.tolist()}, f)
            mask = inputs["attention_mask"]
            rows = [self._row_of[tuple(ids[m.bool()].tolist())]
                    for ids, m in zip(inputs["input_ids"], mask, strict=True)]
            rank = int(os.environ.get("RANK", 0))
            with open(os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.state.global_step + 1, "rows": rows,
                                    "real": int(mask.sum()), "padded": int(mask.numel())}) + "\n")
            return super().training_step(model, inputs, *args, **kwargs)

    return Recording


def _kill_callback():
    from transformers import TrainerCallback

    kill_at = int(os.environ.get("KILL_AT", 0))

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if kill_at and state.global_step == kill_at:
                sys.stdout.flush()
                os._exit(17)

    return Kill()


def main() -> int:
    import llamafactory.train.sft.workflow as workflow
    import llamafactory.train.tuner as tuner

    os.makedirs(os.environ["RECORD_DIR"], exist_ok=True)
    run_exp = tuner.run_exp
    tuner.run_exp = lambda args=None, callbacks=None: run_exp(args, [*(callbacks or []), _kill_callback()])
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
