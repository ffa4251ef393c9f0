"""Inputs of the framework checks (tests/frameworks): a tiny multimodal chat corpus of real image
files (some above LLaMA-Factory's ``image_max_pixels``, so its own resize matters), written in each
framework's dataset format, and the tiny random Qwen2-VL checkpoint folder they train."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

WORDS = ("the cat sat on a mat while red birds sang over green hills near blue water and old "
         "trees watched quiet boats drift past small houses").split()


def corpus(n: int, seed: int = 0) -> list[dict]:
    """``n`` single-turn rows: a question about 0-2 images and an answer of varied length; each row's
    text is unique, so a trained batch names its rows."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        k = rnd.choice((0, 1, 1, 1, 2))
        sizes = [(rnd.randint(40, 420), rnd.randint(40, 420)) for _ in range(k)]
        q = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 30)))
        a = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, 60)))
        rows.append({"id": i, "question": f"row {i} {q}", "answer": a, "sizes": sizes})
    return rows


def write_images(rows: list[dict], folder: Path) -> None:
    """One PNG / JPEG per image of ``rows`` (``row["images"]``: absolute paths)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["images"] = []
        for j, (w, h) in enumerate(r["sizes"]):
            ext = "png" if (r["id"] + j) % 2 else "jpg"
            path = folder / f"{r['id']}_{j}.{ext}"
            color = ((r["id"] * 37) % 256, (j * 91) % 256, 128)
            Image.new("RGB", (w, h), color).save(path)
            r["images"].append(str(path))


def checkpoint(path: Path, rows: list[dict]) -> str:
    """The tiny random Qwen2-VL (tests.helpers.processors.qwen2_vl_checkpoint) with a tokenizer over
    ``rows``' words, its image processor saved under the class name every transformers 4.57-5.x loads."""
    from tests.helpers.processors import qwen2_vl_checkpoint

    text = [f"{r['question']} {r['answer']}" for r in rows] + [" ".join(WORDS)] * 4
    folder = qwen2_vl_checkpoint(path, text, model=True)
    pre = Path(folder) / "preprocessor_config.json"
    cfg = json.loads(pre.read_text())
    cfg["image_processor_type"] = "Qwen2VLImageProcessor"
    pre.write_text(json.dumps(cfg, indent=1))
    return folder


def llamafactory_project(folder: Path, rows: list[dict], model: str, *, extra: dict | None = None) -> Path:
    """A LLaMA-Factory dataset (sharegpt, ``<image>`` placeholders) and a training YAML; returns the
    YAML's path. ``extra``: more top-level keys (``tokenbal: {...}``, ``resume_from_checkpoint``)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = [{"messages": [{"role": "user", "content": "<image>" * len(r["images"]) + r["question"]},
                          {"role": "assistant", "content": r["answer"]}],
             "images": r["images"]} for r in rows]
    (folder / "data.json").write_text(json.dumps(data))
    (folder / "dataset_info.json").write_text(json.dumps({"tiny_mm": {
        "file_name": "data.json", "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant"}}}))
    cfg = {
        "model_name_or_path": model, "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "tiny_mm", "dataset_dir": str(folder), "template": "qwen2_vl", "cutoff_len": 4096,
        "image_max_pixels": 160 * 160, "overwrite_cache": True, "output_dir": str(folder / "out"),
        "logging_steps": 1, "save_steps": 1000, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1, "num_train_epochs": 2, "learning_rate": 1.0e-4,
        "report_to": "none", "ddp_backend": "gloo", "use_cpu": True, "seed": 7,
        "dataloader_num_workers": 0, "disable_tqdm": True, "save_only_model": False,
        "ddp_find_unused_parameters": True, "bf16": False, "resize_vocab": True,
        "disable_gradient_checkpointing": True,
    }
    cfg.update(extra or {})
    import yaml

    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def env_for_ranks() -> dict:
    """Environment of a CPU gloo run: one thread per rank, no GPU probing."""
    return {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DISABLE_VERSION_CHECK": "1",
            "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def swift_dataset(folder: Path, rows: list[dict]) -> Path:
    """The rows as ms-swift's messages + images JSONL (``<image>`` placeholders); returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "data.jsonl"
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": "<image>" * len(r["images"]) + r["question"]},
                {"role": "assistant", "content": r["answer"]}], "images": r["images"]}) + "\n")
    return path


def swift_args(data: Path, model: str, out: Path, *extra: str) -> list[str]:
    """``swift sft`` arguments of a short full fine-tune of the tiny Qwen2-VL on CPU ranks."""
    return ["sft", "--model", model, "--model_type", "qwen2_vl", "--template", "qwen2_vl",
            "--dataset", str(data), "--tuner_type", "full", "--num_train_epochs", "2",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--learning_rate", "1e-4", "--output_dir", str(out), "--add_version", "false",
            "--save_steps", "1000", "--logging_steps", "1", "--dataloader_num_workers", "0",
            "--max_pixels", str(160 * 160), "--torch_dtype", "float32", "--report_to", "none",
            "--ddp_backend", "gloo", "--seed", "7", "--data_seed", "11", "--save_only_model", "false",
            "--ddp_find_unused_parameters", "true", "--gradient_checkpointing", "false", *extra]
