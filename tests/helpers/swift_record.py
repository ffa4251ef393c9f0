"""An ms-swift ``--external_plugins`` file for the framework tests: the trainer ms-swift's mapping
names for ``swift sft`` (tokenbal's, when tokenbal's plugin came first; else ms-swift's own) with
every training step recorded and ``KILL_AT`` honoured (tests.helpers.framework_record)."""

import importlib
import json
import os
import sys

from swift.template.templates.qwen import Qwen2VLTemplate
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


# ms-swift's Qwen2-VL template names its placeholders by Qwen2-VL's vocabulary ids (151655 / 151656,
# class attributes); the tiny test checkpoint's tokenizer has them at small ids. Point the template at
# the checkpoint's own ids (the `--model` folder's config), as they already are for a real checkpoint.
_config = json.load(open(os.path.join(sys.argv[sys.argv.index("--model") + 1], "config.json")))
Qwen2VLTemplate.image_token_id = _config["image_token_id"]
Qwen2VLTemplate.video_token_id = _config["video_token_id"]
start()
TrainerFactory.TRAINER_MAPPING["causal_lm"] = f"{__name__}.Recording"
