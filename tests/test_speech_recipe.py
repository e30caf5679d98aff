"""The recipe of docs/speech.md (a NeMo manifest to a DDP training), its config and training script
as the page has them, run under torchrun with 2 ranks on a small corpus of FLAC files: every rank
takes the steps the server's cut gives it, and a second run resumes from the checkpoints."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import pytest
from conftest import REPO, reference_batches, run_group, shard

pytestmark = [pytest.mark.processes, pytest.mark.torch, pytest.mark.speech]

# what "small form" changes in the page's code: each must occur in it exactly once
SMALL = {
    "config": [("num_workers = 8", "num_workers = 1"), ('"max_duration": 540.0', '"max_duration": 4.0')],
    "train": [("epochs, ckpt = 10,", "epochs, ckpt = EPOCHS,")],
}


def recipe() -> Dict[str, str]:
    text = (Path(REPO) / "docs" / "speech.md").read_text()
    section = re.search(r"## From a manifest to a DDP training\n(.*?)\n## ", text, re.S)
    assert section is not None
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert len(blocks) == 2 and blocks[0].startswith("# config.py") and blocks[1].startswith("# train.py")
    code = {"config": blocks[0], "train": blocks[1]}
    for name, changes in SMALL.items():
        for old, new in changes:
            assert code[name].count(old) == 1, (name, old)
            code[name] = code[name].replace(old, new)
    return code


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A folder short enough for the local server's Unix sockets."""
    path = tempfile.mkdtemp(prefix="pp", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_corpus(folder: Path, n: int) -> None:
    import soundfile as sf

    rng = np.random.RandomState(3)
    letters = list(" abcdefghijklmnopqrstuvwxyz'")
    (folder / "audio").mkdir()
    with open(folder / "train.jsonl", "w") as f:
        for i in range(n):
            seconds = round(float(rng.uniform(0.4, 1.6)), 3)
            t = np.arange(round(seconds * 16000)) / 16000
            samples = 0.3 * np.sin(2 * np.pi * (200 + 40 * i) * t) + 0.01 * rng.randn(len(t))
            sf.write(folder / "audio" / f"utt{i}.flac", samples.astype(np.float32), 16000, format="FLAC")
            text = "".join(rng.choice(letters[1:], 3)) + " " + "".join(rng.choice(letters[1:], 4))
            f.write(json.dumps({"audio_filepath": f"audio/utt{i}.flac", "duration": seconds, "text": text}) + "\n")
    (folder / "chars.txt").write_text("\n".join(["<blank>", *letters]) + "\n")


def run_training(folder: Path, script: str, epochs: int) -> List[str]:
    (folder / "train.py").write_text(script.replace("EPOCHS", str(epochs)))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"]
    res = run_group(argv, timeout=240, text=True, cwd=str(folder), env=dict(os.environ, TMPDIR=str(folder)))
    assert res.returncode == 0, res.stderr[-4000:]
    # (the ranks print to one pipe: a line of one may land inside the other's, so match, not split)
    return sorted(re.findall(r"rank \d+ epoch \d+: \d+ steps", res.stdout))


def test_the_recipe_of_docs_speech_md_trains_on_two_ranks_and_resumes(short_tmp, monkeypatch):
    code = recipe()
    folder = Path(short_tmp)
    write_corpus(folder, 16)
    (folder / "config.py").write_text(code["config"])
    monkeypatch.chdir(folder)  # the config's paths are the server's and workers' working folder's
    batches = reference_batches(str(folder / "config.py"), 1, {"max_duration": 4.0, "bucket_window": 5000})
    steps = len(shard(batches, 0, 2))
    assert steps >= 2 and len(batches) >= 2 * steps
    # the first run trains epoch 1 and saves; the second loads the checkpoints and trains epoch 2 only
    assert run_training(folder, code["train"], 1) == [f"rank {r} epoch 1: {steps} steps" for r in range(2)]
    batches = reference_batches(str(folder / "config.py"), 2, {"max_duration": 4.0, "bucket_window": 5000})
    steps = len(shard(batches, 0, 2))
    assert run_training(folder, code["train"], 2) == [f"rank {r} epoch 2: {steps} steps" for r in range(2)]
    assert sorted(p.name for p in folder.glob("ckpt*.pt")) == ["ckpt0.pt", "ckpt1.pt"]
