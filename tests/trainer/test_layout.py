"""Node layout: device per trainer rank and feature worker, and the errors for layouts a node cannot hold."""

import pytest

from specdistill.trainer.layout import plan_node


def test_production_node_gives_each_process_its_own_gpu():
    layout = plan_node(ranks=2, workers=6, trainer_device="cuda", worker_device="cuda", cuda_devices=8)
    assert layout.trainer_devices == ("cuda:0", "cuda:1")
    assert layout.worker_devices == (("cuda:2", "cuda:3", "cuda:4"), ("cuda:5", "cuda:6", "cuda:7"))
    every = [*layout.trainer_devices, *(d for ws in layout.worker_devices for d in ws)]
    assert len(set(every)) == 8


def test_cpu_layouts_and_auto():
    layout = plan_node(ranks=2, workers=2, trainer_device="auto", worker_device="cpu", cuda_devices=0)
    assert layout.trainer_devices == ("cpu", "cpu") and layout.worker_devices == (("cpu",), ("cpu",))
    mixed = plan_node(ranks=1, workers=3, trainer_device="auto", worker_device="cpu", cuda_devices=1)
    assert mixed.trainer_devices == ("cuda:0",) and mixed.worker_devices == (("cpu", "cpu", "cpu"),)


def test_too_few_devices_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match=r"needs 8 CUDA devices \(2 trainer ranks \+ 6 feature workers.*"
                                           r"this machine has 1 \(CUDA_VISIBLE_DEVICES=0\)"):
        plan_node(ranks=2, workers=6, trainer_device="cuda", worker_device="cuda", cuda_devices=1)
    with pytest.raises(ValueError, match="workers=5 does not split evenly over trainer.ranks=2"):
        plan_node(ranks=2, workers=5, trainer_device="cpu", worker_device="cpu", cuda_devices=0)
    with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
        plan_node(ranks=1, workers=1, trainer_device="cuda:3", worker_device="cpu", cuda_devices=4)


def test_one_gpu_holds_rank_and_worker_only_when_asked(monkeypatch):
    """layout=gpu1 (feature_server.share_trainer_device): the worker runs on its rank's own GPU; without the opt-in
    the same layout on one GPU is refused, naming the opt-in."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one = plan_node(ranks=1, workers=1, trainer_device="cuda", worker_device="cuda", cuda_devices=1,
                    share_trainer_device=True)
    assert one.trainer_devices == ("cuda:0",) and one.worker_devices == (("cuda:0",),)
    with pytest.raises(RuntimeError, match=r"needs 2 CUDA devices \(1 trainer ranks \+ 1 feature workers.*has 1; .*"
                                           r"share_trainer_device=true"):
        plan_node(ranks=1, workers=1, trainer_device="cuda", worker_device="cuda", cuda_devices=1)
    # each rank shares its own GPU with its own workers; auto follows the trainer
    two = plan_node(ranks=2, workers=4, trainer_device="auto", worker_device="auto", cuda_devices=2,
                    share_trainer_device=True)
    assert two.trainer_devices == ("cuda:0", "cuda:1")
    assert two.worker_devices == (("cuda:0", "cuda:0"), ("cuda:1", "cuda:1"))
    # on a CPU trainer there is nothing to share but "cpu"
    cpu = plan_node(ranks=1, workers=2, trainer_device="cpu", worker_device="auto", cuda_devices=0,
                    share_trainer_device=True)
    assert cpu.worker_devices == (("cpu", "cpu"),)


def test_sharing_refuses_too_few_gpus_and_contradictions():
    with pytest.raises(RuntimeError, match=r"needs 2 CUDA devices \(2 trainer ranks, each sharing its device with its "
                                           r"1 feature worker\(s\)\), this machine has 1"):
        plan_node(ranks=2, workers=2, trainer_device="cuda", worker_device="cuda", cuda_devices=1,
                  share_trainer_device=True)
    with pytest.raises(RuntimeError, match="needs 1 CUDA devices .* this machine has 0"):
        plan_node(ranks=1, workers=1, trainer_device="cuda", worker_device="cuda", cuda_devices=0,
                  share_trainer_device=True)
    with pytest.raises(ValueError, match=r"trainer's device \(cuda\), but feature_server.device=cpu"):
        plan_node(ranks=1, workers=1, trainer_device="cuda", worker_device="cpu", cuda_devices=1,
                  share_trainer_device=True)
    with pytest.raises(ValueError, match=r"trainer's device \(cpu\), but feature_server.device=cuda"):
        plan_node(ranks=1, workers=1, trainer_device="cpu", worker_device="cuda", cuda_devices=1,
                  share_trainer_device=True)


def test_torchrun_sets_ranks_and_enough_workers_unless_given():
    from specdistill.trainer.layout import torchrun_sizes

    assert torchrun_sizes(1, 1, None, set()) == (1, 1)  # not under torchrun: unchanged
    assert torchrun_sizes(1, 1, 2, set()) == (2, 2)  # cpu layout, --nproc-per-node 2: a worker per rank
    assert torchrun_sizes(2, 6, 2, set()) == (2, 6)  # production node: already consistent
    assert torchrun_sizes(2, 6, 4, set()) == (4, 8)  # 6 workers do not split over 4 ranks: 2 each
    assert torchrun_sizes(1, 3, 2, {"feature_server.workers"}) == (2, 3)  # given: kept (plan_node then says why)
    assert torchrun_sizes(1, 1, 2, {"trainer.ranks"}) == (1, 1)  # given: kept (Trainer reports the mismatch)


def test_cpu_ranks_split_the_cores_and_cuda_ranks_keep_torchs_default():
    from specdistill.trainer.layout import cpu_threads

    assert cpu_threads(None, "cpu", ranks=1, cores=2) == 2
    assert cpu_threads(None, "cpu", ranks=2, cores=16) == 8 and cpu_threads(None, "cpu", ranks=4, cores=2) == 1
    assert cpu_threads(None, "cuda", ranks=2, cores=16) is None
    assert cpu_threads(3, "cuda", ranks=2) == 3
    with pytest.raises(ValueError, match="trainer.threads=0"):
        cpu_threads(0, "cpu", ranks=1)
