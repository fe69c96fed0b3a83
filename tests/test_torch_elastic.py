"""examples/torch_elastic.py (pycoll/torch/elastic.py): torch DDP on a pycoll group that loses a rank
to SIGKILL mid-training, goes on shrunk, takes the restarted rank back in and heals it; every replica
ends equal."""
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from test_launcher import REPO, _env  # noqa: E402


@pytest.mark.timeout(400)
def test_torch_ddp_loses_a_rank_gets_it_back_and_ends_with_equal_replicas():
    res = subprocess.run([sys.executable, "-m", "pycoll", "run", "--elastic", "--max-restarts", "1", "-n", "3",
                          "examples/torch_elastic.py", "--kill-slot", "2", "--kill-step", "10", "--steps", "20",
                          "--min-ranks", "3"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=380)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "restarted it as a newcomer" in res.stderr, out
    assert re.search(r"ranks \[2\] died at step 10; went on with 2 ranks", res.stdout), out
    assert re.search(r"ranks \[2\] joined after step \d+; went on with 3 ranks", res.stdout), out
    ends = re.findall(r"\[rank (\d)\] rank (\d) of 3: (\d+) steps, loss ([\d.]+), parameters ([0-9a-f]{16})",
                      res.stdout)
    assert len(ends) == 3, out
    assert len({e[2:] for e in ends}) == 1, f"replicas differ at the end: {ends}"  # steps, loss, digest
