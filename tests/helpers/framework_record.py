"""What the framework tests' recording drivers share (``lf_record.py`` for LLaMA-Factory,
``swift_record.py`` for ms-swift): a trainer subclass that writes every training step to
``$RECORD_DIR/rank{r}.jsonl``, and a callback that kills the job after step ``$KILL_AT``.

A step's record: ``step``; ``rows`` (the dataset items of the rank's micro-batch, found by their
token ids; ``None`` for a row that is no dataset item, e.g. one LLaMA-Factory packed itself);
``real`` and ``padded`` tokens; ``packed`` (a tokenbal packed row). On a packed run's first step each
rank also records ``loss`` (what the framework's ``training_step`` returned), and ``ref_sum`` /
``ref_tokens``: Σ over its samples of each sample's own unpacked loss × its loss tokens, and those
tokens (the samples run one by one through the model's unpatched transformers forward)."""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


def _write(name: str, record: dict) -> None:
    with open(os.path.join(os.environ["RECORD_DIR"], name), "a") as f:
        f.write(json.dumps(record) + "\n")


def _rows_of(inputs: dict) -> tuple[list[list[int]], int, int]:
    """(each sample's real token ids, real tokens, padded tokens) of a padded or packed micro-batch."""
    ids = inputs["input_ids"]
    if inputs.get("seq_lens") is not None:   # tokenbal's packed row: samples back to back
        flat, out, start = ids[0].tolist(), [], 0
        for n in inputs["seq_lens"]:
            out.append(flat[start:start + n])
            start += n
        return out, len(flat), int(ids.numel())
    mask = inputs["attention_mask"]
    if mask.dim() == 4:   # LLaMA-Factory's block-diagonal mask (neat_packing): a real token sees itself
        mask = mask.diagonal(dim1=-2, dim2=-1)[:, 0] == 0
    rows = [i[m != 0].tolist() for i, m in zip(ids, mask, strict=True)]
    return rows, int((mask != 0).sum()), int(mask.numel())


def reference_losses(model: Any, inputs: dict) -> tuple[float, int]:
    """Σ (each sample's own loss × its loss tokens), Σ loss tokens over a packed row's samples: every
    sample alone through the model's plain forward (no cu_seqlens: transformers' own path, its own
    ``get_rope_index``), with its labels and its images' pixels and grids."""
    import inspect

    import torch

    # transformers 5.6 and newer want the token types with the grids (older ones have no such input)
    types = "mm_token_type_ids" in inspect.signature(type(model).forward).parameters
    merge = int(getattr(model.config.vision_config, "spatial_merge_size", 2))
    ids, labels = inputs["input_ids"][0], inputs["labels"][0]
    # per kind: its placeholder id, token type, grids, pixels, and the next grid / pixel row to take
    kinds = [{"token": int(token), "type": kind_type, "grids": inputs.get(grid_key),
              "pixels": inputs.get(pix_key), "g": 0, "p": 0, "keys": (pix_key, grid_key)}
             for token, kind_type, pix_key, grid_key in (
                 (model.config.image_token_id, 1, "pixel_values", "image_grid_thw"),
                 (getattr(model.config, "video_token_id", -1), 2, "pixel_values_videos", "video_grid_thw"))]
    total, tokens, start = 0.0, 0, 0
    with torch.no_grad():
        for n in inputs["seq_lens"]:
            s_ids, s_labels = ids[start:start + n], labels[start:start + n]
            start += n
            kw, token_types = {}, torch.zeros_like(s_ids)
            for k in kinds:
                want, got, first_g, first_p = int((s_ids == k["token"]).sum()), 0, k["g"], k["p"]
                while got < want:
                    cells = int(k["grids"][k["g"]].prod())
                    got += cells // merge**2
                    k["p"] += cells
                    k["g"] += 1
                if want:
                    kw[k["keys"][0]] = k["pixels"][first_p:k["p"]]
                    kw[k["keys"][1]] = k["grids"][first_g:k["g"]]
                    token_types[s_ids == k["token"]] = k["type"]
            if kw and types:
                kw["mm_token_type_ids"] = token_types[None]
            count = int((s_labels[1:] != -100).sum())
            if count == 0:
                continue
            out = model(input_ids=s_ids[None], labels=s_labels[None],
                        attention_mask=torch.ones_like(s_ids)[None], **kw)
            total += float(out.loss) * count
            tokens += count
    return total, tokens


def recording(base: type, framework: str, all_ids: Callable[[Any], list[list[int]]]) -> type:
    """``base`` with every training step recorded; ``all_ids(trainer)``: every dataset item's token
    ids, in dataset order (rank 0 also writes ``lengths.json``: the framework's lengths beside the
    ones tokenbal planned with)."""

    class Recording(base):
        def training_step(self, model, inputs, *args, **kwargs):
            if not hasattr(self, "_row_of"):
                ids = all_ids(self)
                self._row_of = {tuple(i): n for n, i in enumerate(ids)}
                if _rank() == 0:
                    planned = getattr(self, "tokenbal_sampler", None)
                    video = getattr(self.model.config, "video_token_id", None)
                    with open(os.path.join(os.environ["RECORD_DIR"], "lengths.json"), "w") as f:
                        json.dump({framework: [len(i) for i in ids],
                                   "tokenbal": None if planned is None else planned.lengths.tolist(),
                                   "video_tokens": [sum(t == video for t in i) for i in ids]}, f)
            rows, real, padded = _rows_of(inputs)
            packed = inputs.get("seq_lens") is not None
            record = {"step": self.state.global_step + 1, "rows": [self._row_of.get(tuple(r)) for r in rows],
                      "real": real, "padded": padded, "packed": packed}
            first = packed and self.state.global_step == 0
            if first:
                record["ref_sum"], record["ref_tokens"] = reference_losses(self.model, inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            if first:
                record["loss"] = float(loss)
                items = args[0] if args else kwargs.get("num_items_in_batch")
                record["num_items_in_batch"] = None if items is None else int(items)
                record["distributed_type"] = str(self.accelerator.distributed_type)
            _write(f"rank{_rank()}.jsonl", record)
            return loss

    return Recording


def kill_callback() -> Any:
    """Every rank exits hard after step ``$KILL_AT`` (as a killed job would: nothing after the last
    checkpoint is saved); no-op without it."""
    from transformers import TrainerCallback

    kill_at = int(os.environ.get("KILL_AT", 0))

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if kill_at and state.global_step == kill_at:
                sys.stdout.flush()
                os._exit(17)

    return Kill()


def start() -> None:
    os.makedirs(os.environ["RECORD_DIR"], exist_ok=True)
    # Registered before training, so it runs after every atexit callback registered later (tokenbal's
    # destroy_process_group_at_exit among them): what is still running as the interpreter finalises.
    if "RANK" in os.environ:    # a rank, not a launcher
        atexit.register(_record_exit)


def gloo_threads() -> int:
    """This process's gloo threads (a process group's workers and its TCP loop), by OS thread name."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def _record_exit() -> None:
    """``$RECORD_DIR/exit{r}.json``: whether the default group is still initialised, and the gloo
    threads still running, at interpreter exit (a gloo rank whose threads run while Python finalises
    can abort: pytorch#190489)."""
    import torch.distributed as dist

    record = {"group": dist.is_available() and dist.is_initialized(),
              "gloo_threads": gloo_threads() if os.path.isdir("/proc/self/task") else None}
    with open(os.path.join(os.environ["RECORD_DIR"], f"exit{_rank()}.json"), "w") as f:
        json.dump(record, f)
