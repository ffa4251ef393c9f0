"""An ms-swift ``--external_plugins`` file for tests/frameworks: the trainer ms-swift's mapping names
for ``swift sft`` (tokenbal's, when tokenbal's plugin came first; else ms-swift's own) with every
training step recorded in ``$RECORD_DIR/rank{r}.jsonl`` (step, the dataset items of the micro-batch,
real and padded tokens); ``KILL_AT=N``: every rank exits hard after step N."""

import importlib
import json
import os
import sys

from swift.trainers.trainer_factory import TrainerFactory

_path = TrainerFactory.TRAINER_MAPPING["causal_lm"]
_module, _name = _path.rsplit(".", 1)
_base = getattr(importlib.import_module(_module), _name)


class Recording(_base):
    def training_step(self, model, inputs, *args, **kwargs):
        if not hasattr(self, "_row_of"):
            ds = self.train_dataset
            self._row_of = {tuple(ds[i]["input_ids"]): i for i in range(len(ds))}
            if int(os.environ.get("RANK", 0)) == 0:
                planned = getattr(self, "tokenbal_sampler", None)
                with open(os.path.join(os.environ["RECORD_DIR"], "lengths.json"), "w") as f:
                    json.dump({"swift": [len(ds[i]["input_ids"]) for i in range(len(ds))],
                               "tokenbal": None if planned is None else planned.lengths.tolist()}, f)
        mask = inputs["attention_mask"]
        rows = [self._row_of[tuple(ids[m.bool()].tolist())]
                for ids, m in zip(inputs["input_ids"], mask, strict=True)]
        rank = int(os.environ.get("RANK", 0))
        with open(os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.state.global_step + 1, "rows": rows, "real": int(mask.sum()),
                                "padded": int(mask.numel())}) + "\n")
        return super().training_step(model, inputs, *args, **kwargs)


def _kill_callback():
    from transformers import TrainerCallback

    kill_at = int(os.environ.get("KILL_AT", 0))

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if kill_at and state.global_step == kill_at:
                sys.stdout.flush()
                os._exit(17)

    return Kill()


_init = Recording.__init__


def _with_kill(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_callback(_kill_callback())


Recording.__init__ = _with_kill
os.makedirs(os.environ["RECORD_DIR"], exist_ok=True)
TrainerFactory.TRAINER_MAPPING["causal_lm"] = f"{__name__}.Recording"
