import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported (tiny imports it)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Cost tables are refused when other processes use the CPU while they are measured
# (engine/lab/timing.py); the suite's own workers do, by design. The tests of that refusal set it.
os.environ.setdefault("SPECLAB_BUSY_CORES", "inf")
# The CLI's prefix disk tier writes beside the user's converted models; the suite's runs write here.
os.environ.setdefault("SPECLAB_PREFIX_DIR", tempfile.mkdtemp(prefix="speclab-prefix-kv-"))
os.environ.setdefault("SPECLAB_KERNEL_DIR", tempfile.mkdtemp(prefix="speclab-kernels-"))  # each run probes anew
# Under pytest-xdist (`make test`) the cores are shared out among the workers, before torch is
# imported and for every process a test starts (CLI runs, the app server, Ray's workers): two
# processes with a thread per core each would contend for both cores and slow each other tenfold.
if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

from tiny import save_tiny_llama  # noqa: E402  (tests/ is on sys.path: pytest puts a rootdir conftest's folder there)

# The files that take over two minutes of a worker's time in `make test`, longest first (measured:
# 1,380, 869, 691, 218, 170 and 149 s at one thread). Under xdist they are collected, so handed
# out, in this order (`--no-loadscope-reorder`), the rest after them: xdist's own order (most tests
# first) started the browser walk-through 23 minutes in, to end alone 4.6 minutes after the other
# worker (37 min 19 s, where an even split of the same 3,928 worker-seconds is 32 min 44 s).
LONGEST_FIRST = ("test_real_model.py", "test_browser.py", "test_real_model_tiers.py", "test_lab.py",
                 "test_speculative.py", "test_cluster.py")


def pytest_collection_modifyitems(config, items: list) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's collection is what the scheduler hands out
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): a tiny random target and a noisy copy of it as the draft."""
    root = tmp_path_factory.mktemp("tiny")
    target = save_tiny_llama(root / "target", seed=0)
    draft = save_tiny_llama(root / "draft", seed=1, base=target, noise=0.15)
    return target, draft


@pytest.fixture(scope="session")
def tiny_pair(tiny_dirs):
    from engine.runtime.models import load_pair

    target, draft = tiny_dirs
    return load_pair(str(target), str(draft), target_tier="fp32", device="cpu")


@pytest.fixture(scope="module")
def eagle_pair(tiny_pair):
    """The tiny pair with a random EAGLE head over half the vocabulary. Per module: its feature
    tap hooks the shared tiny target and is removed when the module ends."""
    import dataclasses

    import torch

    from engine.runtime import eagle_head as eaglelib

    target = tiny_pair.target
    emb = target.get_input_embeddings().weight.detach().float()
    torch.manual_seed(0)
    head = eaglelib.build_head(target, emb, torch.arange(0, emb.shape[0], 2))
    tap = eaglelib.FeatureTap(target)
    yield dataclasses.replace(tiny_pair, eagle=head.eval(), feature_tap=tap, eagle_name="tiny eagle")
    tap.close()


from apptest import app_env  # noqa: E402,F401 - the workbench's AppTest fixture
