"""An ms-swift ``--external_plugins`` file for the framework tests: the trainer ms-swift's mapping
names for ``swift sft`` (tokenbal's, when tokenbal's plugin came first; else ms-swift's own) with
every training step recorded and ``KILL_AT`` honoured (tests.helpers.framework_record)."""

import importlib

from swift.trainers.trainer_factory import TrainerFactory

from tests.helpers.framework_record import kill_callback, recording, start

_module, _name = TrainerFactory.TRAINER_MAPPING["causal_lm"].rsplit(".", 1)


def _ids(trainer):
    ds = trainer.train_dataset
    return [list(ds[i]["input_ids"]) for i in range(len(ds))]


class Recording(recording(getattr(importlib.import_module(_module), _name), "swift", _ids)):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(kill_callback())


start()
TrainerFactory.TRAINER_MAPPING["causal_lm"] = f"{__name__}.Recording"
