"""tinker-cookbook 0.6.1's own loops (``recipes/sl_loop.py``, ``recipes/rl_loop.py``, their ``main``
through the cookbook's command line), unchanged, against ``trellis serve`` on the tiny model, offline.

Only what cannot be reached offline is replaced, through the libraries' own mechanisms: the loops
run in a folder holding ``Qwen/Qwen3-8B-Base/`` (the tiny model and its tokenizer: the cookbook's
``get_tokenizer`` loads a model name that is a local folder, and picks its renderer, ``role_colon``,
from the name) and the hub data sets as local folders of the same shape
(``HuggingFaceH4/no_robots``, ``openai/gsm8k``), which ``datasets.load_dataset`` reads as local
data. The server serves the tiny model under that name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from served import TOKEN, start_server, stop_server

pytest.importorskip("tinker_cookbook")
datasets = pytest.importorskip("datasets")

NAME = "Qwen/Qwen3-8B-Base"  # a name in the cookbook's tables (renderer role_colon: "User: ...\n\nAssistant: ...")


def conversations(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i % 9, (i * 5) % 7
        rows.append({"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"The answer is {a + b}."}]})
    return rows


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from trellis_demo.tiny import make_tiny_model

    cwd = tmp_path_factory.mktemp("cookbook")
    rows = conversations(64)
    texts = [f"User: {r['messages'][0]['content']}\n\nAssistant: {r['messages'][1]['content']}\n\n" for r in rows]
    make_tiny_model(cwd / NAME, texts, hidden_size=32, num_layers=2, tie_word_embeddings=False, max_position_embeddings=1024)
    data = cwd / "HuggingFaceH4" / "no_robots" / "data"
    data.mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(data / "train-00000-of-00001.parquet"))
    return cwd


def run_loop(module: str, cwd: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cwd / "hf-home"),
        "TINKER_TELEMETRY": "0",
        "TINKER_API_KEY": TOKEN,
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", module, f"base_url={url}", f"model_name={NAME}", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sl_loop_learns(workdir, tmp_path):
    server = start_server({NAME: str(workdir / NAME)}, tmp_path / "root")
    try:
        log = tmp_path / "sl"
        run_loop(
            "tinker_cookbook.recipes.sl_loop",
            workdir,
            server.url,
            "batch_size=8",
            "learning_rate=1e-2",
            "lora_rank=8",
            "max_length=256",
            "save_every=2",
            f"log_path={log}",
        )
    finally:
        stop_server(server)
    nll = [m["train_mean_nll"] for m in rows(log / "metrics.jsonl") if "train_mean_nll" in m]
    assert len(nll) == 8, nll
    assert nll[-1] < 0.7 * nll[0], nll  # measured 5.65 -> 3.07 (the loop decays the LR to 0 over its 8 steps)
    saved = rows(log / "checkpoints.jsonl")
    assert [r["name"] for r in saved] == ["000002", "000004", "000006", "final"]
    assert saved[-1]["state_path"].startswith("tinker://") and saved[-1]["sampler_path"].endswith("/sampler_weights/final")


BOXED = "\\boxed{7}"  # one ordinary token of the RL model's vocabulary, so a random policy says the answer by chance


@pytest.fixture(scope="module")
def rl_workdir(tmp_path_factory) -> Path:
    """The tiny model with ``\\boxed{7}`` added to its vocabulary, and GSM8K-shaped rows whose answer is 7."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trellis_demo.tiny import make_tiny_model

    cwd = tmp_path_factory.mktemp("cookbook-rl")
    rows = [{"question": f"What is {a} + {7 - a}?", "answer": f"{a} + {7 - a} = 7\n#### 7"} for a in range(8)] * 24
    texts = [f"User: {r['question']} Provide a numerical answer without units, written inside \\boxed{{}}.\n\nAssistant: " for r in rows[:8]]
    folder = make_tiny_model(cwd / NAME, texts, hidden_size=32, num_layers=2, tie_word_embeddings=False, max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([BOXED])
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gsm8k = cwd / "openai" / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    config = "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*.parquet\n---\n"
    (gsm8k / "README.md").write_text(config)
    datasets.Dataset.from_list(rows).to_parquet(str(gsm8k / "main" / "train-00000-of-00001.parquet"))
    return cwd


def test_rl_loop_reward_rises(rl_workdir, tmp_path):
    """GSM8K-shaped questions whose answer is always 7: the reward rises as the policy learns to say
    ``\\boxed{7}``. The loop's default loss, stable_reinforce, is not served: importance_sampling is
    chosen on its command line (a config value, not a code change)."""
    server = start_server({NAME: str(rl_workdir / NAME)}, tmp_path / "root")
    try:
        log = tmp_path / "rl"
        args = ["batch_size=8", "group_size=8", "max_tokens=16", "learning_rate=1e-2", "lora_rank=8", "loss_fn=importance_sampling", "save_every=0"]
        run_loop("tinker_cookbook.recipes.rl_loop", rl_workdir, server.url, *args, f"log_path={log}")
    finally:
        stop_server(server)
    reward = [m["reward/total"] for m in rows(log / "metrics.jsonl") if "reward/total" in m]
    assert len(reward) == 24, reward
    # measured: 0.03 for the first 8 steps, then 0.08, 0.2, 0.58, 0.94 and 1.0 from step 18 on
    assert sum(reward[:4]) / 4 < 0.1 and sum(reward[-4:]) / 4 > 0.8, reward
