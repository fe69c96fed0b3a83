"""Ray Train's TorchTrainer training a few steps on the backends named on the command line, on a Ray
instance of its own that only uses loopback and is shut down at the end (or after --timeout seconds):

    python tests/framework_jobs/ray_job.py --backends pycoll,gloo --out DIR

Unmodified Ray Train: `TorchConfig(backend="pycoll")` is the one line that selects pycoll (Ray starts the
workers and calls init_process_group in them). Each worker of the run on backend B writes its final weights
to DIR/B/rank<R>.pt. With --gloo-group the workers of each run also train the same model a second time
through DDP over a gloo group made beside the run's own (`dist.new_group(backend="gloo")`), into
DIR/B+gloo-group/rank<R>.pt: a gloo reference at the cost of one Ray run instead of two.
"""
import argparse
import os
import shutil
import signal
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# On Linux Ray swaps a loopback node address for the host's routable one (services.resolve_ip_for_localhost);
# with "clusters" off it keeps loopback, so the workers' MASTER_ADDR and every Ray port stay on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)  # for workers

import ray  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402


def train(config: dict) -> None:
    """Ray's training function: prepare_model / prepare_data_loader, a few SGD steps, the weights written."""
    import torch.distributed as dist
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader
    import common

    def run(process_group=None):
        kwargs = {"parallel_strategy_kwargs": {"process_group": process_group}} if process_group else {}
        net = common.model()
        model = ray.train.torch.prepare_model(net, **kwargs)
        opt = common.optimizer(model.parameters())
        loader = ray.train.torch.prepare_data_loader(DataLoader(common.dataset(), batch_size=common.BATCH))
        for step, (x, y) in zip(range(common.STEPS), loader):
            opt.zero_grad()
            common.loss(model(x), y).backward()
            opt.step()
        return dict(net.named_parameters())

    rank = ray.train.get_context().get_world_rank()
    common.save(os.path.join(config["out"], config["backend"]), rank, run(), dist.get_backend())
    if config["gloo_group"]:
        group = dist.new_group(backend="gloo")
        common.save(os.path.join(config["out"], config["backend"] + "+gloo-group"), rank, run(group),
                    dist.get_backend(group))


def _timeout(signum, frame):
    raise TimeoutError("ray_job.py: --timeout passed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="pycoll,gloo", help="comma-separated, one Ray Train run each")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gloo-group", action="store_true")
    parser.add_argument("--timeout", type=int, default=240, help="seconds before the job gives up")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _timeout)
    signal.signal(signal.SIGTERM, _timeout)
    signal.alarm(args.timeout)
    scratch = tempfile.mkdtemp(prefix="ray")  # Ray's sessions and run storage: private, removed at the end
    try:
        ray.init(num_cpus=args.workers, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir=os.path.join(scratch, "t"))
        for backend in args.backends.split(","):
            TorchTrainer(train, train_loop_config={"out": os.path.abspath(args.out), "backend": backend,
                                                   "gloo_group": args.gloo_group},
                         scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
                         torch_config=TorchConfig(backend=backend, timeout_s=60),
                         run_config=RunConfig(storage_path=os.path.join(scratch, "runs"), name=backend)).fit()
    finally:
        signal.alarm(0)
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"ray_job.py: done ({args.backends} on {args.workers} workers)", file=sys.stderr)


if __name__ == "__main__":
    main()
