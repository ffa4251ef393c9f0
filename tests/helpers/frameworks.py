"""Inputs and checks of the LLaMA-Factory / ms-swift framework tests
(tests/tokenbal/integrations/frameworks): a tiny multimodal chat corpus of real image files (some
above LLaMA-Factory's ``image_max_pixels``, so its own resize matters), written in each framework's
dataset format, the tiny random Qwen2-VL checkpoint folder they train, and what both tests assert on
the steps their recording drivers (tests.helpers.framework_record) wrote."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import time
from pathlib import Path

from tests.helpers.dist_utils import free_port
from tests.helpers.paths import REPO

__all__ = ["free_port"]   # the tests' free loopback port, where the framework tests look for it

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


def write_videos(rows: list[dict], folder: Path, seed: int = 1) -> None:
    """Gives every other row one real mp4 (``row["videos"]``: absolute paths) of 3-40 frames at 1-30
    fps and 40-300 px per side, so LLaMA-Factory's ``video_fps`` / ``video_maxlen`` sampling and
    ``video_max_pixels`` resize all matter."""
    from tests.helpers.videos import write_video

    rnd = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["videos"] = []
        if r["id"] % 2:
            continue
        path = folder / f"{r['id']}.mp4"
        n, fps = rnd.randint(3, 40), rnd.choice((1, 2, 5, 12, 30))
        w, h = 2 * rnd.randint(20, 150), 2 * rnd.randint(20, 150)   # even sides: yuv420p
        write_video(str(path), n, w, h, fps)
        r["videos"].append(str(path))


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
    videos = any(r.get("videos") for r in rows)
    data = [{"messages": [{"role": "user", "content": "<video>" * len(r.get("videos", ())) +
                           "<image>" * len(r["images"]) + r["question"]},
                          {"role": "assistant", "content": r["answer"]}],
             "images": r["images"], **({"videos": r.get("videos", [])} if videos else {})} for r in rows]
    (folder / "data.json").write_text(json.dumps(data))
    (folder / "dataset_info.json").write_text(json.dumps({"tiny_mm": {
        "file_name": "data.json", "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images", **({"videos": "videos"} if videos else {})},
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
            "--ddp_find_unused_parameters", "true", "--gradient_checkpointing", "false",
            # without it accelerate sees no distributed CPU run (DistributedType.NO): no DDP, no gathers
            "--use_cpu", "true", *extra]


# -- running a framework's CLI ------------------------------------------------------------------------

def driver_environ() -> dict:
    """The environment of the verl / VeOmni / torchtitan drivers: this checkout on PYTHONPATH, one
    thread per rank."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def prepared_env(env: str, driver: Path | None = None, tmp: Path | None = None,
                 environ: dict | None = None) -> Path:
    """The python of environment ``env`` (built on first use; the time it took is printed), after
    ``DRIVER prepare TMP`` ran in it when a driver is given (the verl / VeOmni / torchtitan tests)."""
    from tests.helpers.envs import env_python

    start = time.monotonic()
    python = Path(env_python(env))
    print(f"{env} environment ready in {time.monotonic() - start:.0f} s: {python}")
    if driver is not None:
        prep = subprocess.run([str(python), str(driver), "prepare", str(tmp)], env=environ,
                              capture_output=True, text=True, timeout=600)
        assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-6000:]
    return python


def driver_on_ranks(python: Path, driver: Path, tmp: Path, environ: dict, name: str, ranks: int = 2) -> list:
    """``DRIVER TMP`` on ``ranks`` gloo ranks under torchrun; returns each rank's
    ``TMP/NAME.rank{r}.json``."""
    start = time.monotonic()
    cmd = [str(python), "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-port", str(free_port()), str(driver), str(tmp)]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=900)
    print(f"{name} data path, {ranks} ranks: {time.monotonic() - start:.0f} s")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]


def setup(env: str, root: Path, n: int) -> dict:
    """What a framework test module starts from: environment ``env`` (built on first use; the time
    it took is printed), ``n`` corpus rows with their image files under ``root``, and the tiny
    Qwen2-VL checkpoint over them."""
    python = prepared_env(env)
    rows = corpus(n)
    write_images(rows, root / "images")
    model = checkpoint(root / "Qwen2-VL-tiny", rows)
    return {"python": python, "root": root, "rows": rows, "model": model}


def run_cli(cmd: list[str], name: str, env: dict) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root with the CPU-rank environment, this checkout first on
    PYTHONPATH and ``env`` on top; output captured, the wall time printed."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, **env_for_ranks(), "PYTHONPATH": path, **env}
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=1200)
    print(f"{name}: rc {done.returncode} in {time.monotonic() - start:.0f} s")
    return done


def assert_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]


# -- what the recording drivers wrote ----------------------------------------------------------------

def assert_exit_clean(record: Path, world: int) -> None:
    """Every rank of a finished run reached interpreter exit with its process group destroyed and no
    gloo thread still running (``exit{r}.json`` of tests.helpers.framework_record): a gloo rank whose
    threads run while Python finalises can abort after a finished training (pytorch#190489), and
    torchrun then returns 1."""
    exits = [json.loads((record / f"exit{r}.json").read_text()) for r in range(world)]
    assert all(not e["group"] and e["gloo_threads"] in (0, None) for e in exits), exits


def steps(record: Path, world: int) -> dict[int, list[dict]]:
    """step -> each rank's record of it, in rank order."""
    out: dict[int, list[dict]] = {}
    for r in range(world):
        for line in (record / f"rank{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            out.setdefault(rec["step"], []).append(rec)
    return out


def figures(steps_: dict[int, list[dict]]) -> tuple[float, float]:
    """(mean over steps of max ÷ mean real tokens over the ranks, padded ÷ real tokens in all)."""
    ratios = [max(r["real"] for r in recs) / (sum(r["real"] for r in recs) / len(recs))
              for recs in steps_.values()]
    padded = sum(r["padded"] for recs in steps_.values() for r in recs)
    real = sum(r["real"] for recs in steps_.values() for r in recs)
    return sum(ratios) / len(ratios), padded / real


def assert_beats_default(steps_: dict, default: dict, name: str) -> None:
    """tokenbal's padded steps against the framework's default sampler's on the same rows: better
    per-step balance and less padding (both figures printed)."""
    balance, pad = figures(steps_)
    d_balance, d_pad = figures(default)
    print(f"per-step max/mean real tokens: tokenbal {balance:.3f}, {name} default {d_balance:.3f}; "
          f"padded/real: tokenbal {pad:.3f}, default {d_pad:.3f}")
    assert balance < d_balance
    assert pad < d_pad


def batches(steps_: dict[int, list[dict]]) -> dict[int, list[list[int]]]:
    """step -> each rank's rows, in rank order."""
    return {s: [r["rows"] for r in recs] for s, recs in steps_.items()}


def epochs_of(steps_: dict[int, list[dict]], n: int, epochs: int, world: int) -> list[int]:
    """Asserts every rank trained every step and every row exactly once per epoch; returns each
    epoch's number of steps (a token budget's epochs may differ in length)."""
    assert sorted(steps_) == list(range(1, len(steps_) + 1))
    assert all(len(recs) == world for recs in steps_.values())           # every rank, every step
    out, seen, count = [], [], 0
    for s in sorted(steps_):
        seen += [i for r in steps_[s] for i in r["rows"]]
        count += 1
        if len(seen) >= n:
            assert sorted(seen) == list(range(n)), f"epoch {len(out)}"  # each row once
            out.append(count)
            seen, count = [], 0
    assert not seen and len(out) == epochs, (out, seen)
    return out


def assert_resumed(full: dict, killed: dict, resumed: dict, save_at: int, kill_at: int) -> None:
    """The killed run trained the full run's first steps, the resumed one exactly the rest after
    the checkpoint at ``save_at``."""
    full, k_steps, r_steps = batches(full), batches(killed), batches(resumed)
    assert sorted(k_steps) == list(range(1, kill_at + 1))
    assert k_steps == {s: full[s] for s in k_steps}
    assert r_steps == {s: full[s] for s in range(save_at + 1, max(full) + 1)}


def assert_packed(steps_: dict[int, list[dict]], budget: int) -> None:
    """Every micro-batch one packed row, no padding, at most ``budget`` real tokens per rank."""
    for recs in steps_.values():
        for r in recs:
            assert r["packed"] and r["padded"] == r["real"], r
            assert r["real"] <= budget, r


def assert_first_step_loss(steps_: dict[int, list[dict]], *, global_mean: bool) -> list[float]:
    """The first step's training loss on every rank against its samples' own unpacked losses:
    LLaMA-Factory's normalisation (``global_mean=False``), the token mean of the rank's packed row;
    ms-swift's (``True``), the row's loss sum over all ranks' loss tokens × the world size (the
    global token mean, as DDP averages the ranks' gradients). Returns the losses."""
    recs = steps_[1]
    assert all(r["distributed_type"] != "DistributedType.NO" for r in recs), recs   # a real DDP run
    world, tokens = len(recs), sum(r["ref_tokens"] for r in recs)
    out = []
    for r in recs:
        expect = r["ref_sum"] / tokens * world if global_mean else r["ref_sum"] / r["ref_tokens"]
        assert math.isfinite(r["loss"])
        assert math.isclose(r["loss"], expect, rel_tol=1e-4), (r["loss"], expect)
        out.append(r["loss"])
    return out
