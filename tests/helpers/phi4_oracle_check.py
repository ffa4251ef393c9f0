"""``dataset_lengths`` on image rows against the real ``Phi4MultimodalProcessor`` (its image processor
needs torchvision; CI's venv has none). Run as ``python -m tests.helpers.phi4_oracle_check N_ROWS SEED``
with this checkout on PYTHONPATH (``tests/tokenbal/integrations/test_lengths_phi4.py::
test_real_phi4_processor`` does, in a ``tf-X.Y-video`` env). Prints one JSON line per processor
setting (``dynamic_hd``, plain class or a user's subclass): rows where both agree, rows both reject
(the processor raising, tokenbal naming the row), and every disagreement.

The oracle (``family_processors.oracle``): the processor's chat template rendered, the images handed
to the processor's own ``__call__`` (its crop grid, mask and ``replace_image_token``), tokenized with
the special-token rule.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

SETTINGS = [({"dynamic_hd": 4}, False), ({"dynamic_hd": 12}, True), ({}, True)]   # {}: the hub's 36


def main(n_rows: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    from tests.helpers import family_processors as fp
    from tokenbal.integrations.hf_lengths import dataset_lengths
    from tokenbal.integrations.trainer_support import process_row

    folder = Path(tempfile.mkdtemp(prefix="tokenbal-phi4-"))
    failed = 0
    for k, (settings, subclass) in enumerate(SETTINGS):
        proc = fp.phi4_processor(real=True, subclass=subclass, **settings)
        raw = fp.phi4_rows(n_rows, seed + k)
        (folder / str(k)).mkdir()
        rows = fp.materialise(raw, folder / str(k))
        agree, rejected, accepted, wrong = fp.tally_lengths(proc, rows, [_processor_length(proc, row)
                                                                         for row in rows])
        n_images = [len(raw[i]["images"]) for i in accepted]
        # the packed Trainer's collator step (process_row) on the counted rows: the counted length
        collated = 0
        for i in accepted[:30]:
            got = len(process_row(rows[i], proc)["input_ids"])
            collated += 1
            want = int(dataset_lengths([rows[i]], proc)[0])
            if got != want:
                wrong.append({"row": i, "process_row": got, "dataset_lengths": want,
                              "shape": rows[i]["shape"]})
        failed += bool(wrong)
        print(json.dumps({"processor": type(proc).__name__, "settings": settings, "rows": len(rows),
                          "agree": agree, "rejected": rejected, "n_wrong": len(wrong), "wrong": wrong[:5],
                          "process_row": collated,
                          "images_per_row": sorted(set(n_images)),
                          "shapes": sorted({rows[i]["shape"] for i in accepted})}), flush=True)
    return 1 if failed else 0


def _processor_length(proc, row: dict) -> int | str:
    """The processor's own ``input_ids`` length of the row, or why it rejects the row."""
    from tests.helpers import family_processors as fp

    try:
        return fp.oracle(proc, row)
    except ValueError as e:
        return f"processor raises: {str(e)[:80]}"


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
