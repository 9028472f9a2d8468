"""mp_exit.py - run by tests/test_multiprocess.py under tests/cpu_launch.py (2 processes): end
training ROUNDS times as train.py does (an all-reduce, then plumbing.distributed.end_training, then
the DDP model dropped), each round on a fresh gloo process group. `plain` as the first argument
ends with accelerate's end_training alone, as train.py did before (a race that can hang: a DDP
Reducer destroying the group with the GIL held while gloo's worker waits for the GIL)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from plumbing.distributed import end_training, release_kept_groups  # noqa: E402 (after sys.path)

ROUNDS = 15


class Ending:  # what end_training needs of an accelerator: accelerate's end_training destroys the group
    def end_training(self):
        dist.destroy_process_group()


def main(plain: bool, store_dir: str):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for i in range(ROUNDS):
        store = dist.FileStore(os.path.join(store_dir, f"store-{i}"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        model(torch.ones(2, 4)).sum().backward()  # the gradients' all-reduce
        total = torch.ones(1)
        dist.all_reduce(total)  # the last collective (plumbing.checkpoints.agree's, in train.py)
        assert total.item() == world
        if plain:
            Ending().end_training()
        else:
            end_training(Ending())
        del model  # train() returning: its Reducer goes
        if not plain:
            release_kept_groups()  # at exit in train.py (atexit); here after each round
    sys.stdout.write(f"rank {rank}: {ROUNDS} rounds ended\n")  # one write: the ranks share a pipe


if __name__ == "__main__":
    main(sys.argv[1] == "plain", sys.argv[2])
