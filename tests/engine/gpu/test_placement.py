"""Which physical GPU a `device` names on a 4-GPU host (fake NVML), under CUDA_VISIBLE_DEVICES or
not; leases of several GPUs taken all or none; `nsconsole new` and `check` refusing a GPU the host
does not have."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line
from helpers.nvml import FakeNvmlHost, fake_uuid

from engine.config.run import RunConfig
from engine.errors import ConfigError, LineError
from engine.gpu.devices import GpuLease, GpuSnapshot, gpu_snapshot, lease_holder, take_free_leases
from engine.gpu.placement import (
    PlacementError,
    child_environment,
    device_finding,
    gpu_candidates,
    placed_device,
)
from engine.ops.check import check_line
from engine.ops.new import NewLineOptions, new_line


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvmlHost:
    """A 4-GPU host this process reads through the stand-in pynvml; no CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvmlHost(tmp_path / "nvml.json", count=4)
    fake.install(monkeypatch)
    return fake


def indices(device: str, environ: dict[str, str] | None = None) -> list[int] | None:
    gpus = gpu_candidates(device, gpu_snapshot(), environ if environ is not None else {})
    return None if gpus is None else [gpu.index for gpu in gpus]


def test_the_fake_host_reads_through_the_real_nvml_code(host: FakeNvmlHost) -> None:
    snapshot = gpu_snapshot()
    assert snapshot.available and snapshot.driver == "580.159.04"
    assert [(device.index, device.uuid) for device in snapshot.devices] == [(i, fake_uuid(i)) for i in range(4)]
    host.set_processes(2, [(4242, 3 << 30)])
    assert [(p.pid, p.used_memory) for p in gpu_snapshot().devices[2].processes] == [(4242, 3 << 30)]


def test_devices_name_gpus_in_nvml_order_without_cuda_visible_devices(host: FakeNvmlHost) -> None:
    assert indices("auto") == [0, 1, 2, 3]
    assert indices("cuda") == [0, 1, 2, 3]
    assert indices("cuda:2") == [2]
    assert indices("cpu") is None


def test_cuda_n_is_the_n_th_visible_gpu_mapped_to_its_physical_one(host: FakeNvmlHost) -> None:
    assert indices("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == [3]
    assert indices("cuda:0", {"CUDA_VISIBLE_DEVICES": "3,1"}) == [3]
    assert indices("auto", {"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    # UUIDs, whole or a unique prefix (as CUDA takes them), and an index mixed in.
    by_uuid = {"CUDA_VISIBLE_DEVICES": f"{fake_uuid(2)},{fake_uuid(0)[:12]},1"}
    assert indices("auto", by_uuid) == [2, 0, 1]
    assert indices("cuda:2", by_uuid) == [1]
    # A negative entry ends the list, as in CUDA; an empty list hides every GPU.
    assert indices("auto", {"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == [1]
    assert indices("auto", {"CUDA_VISIBLE_DEVICES": ""}) is None


@pytest.mark.parametrize(
    ("device", "environ", "problem"),
    [
        ("cuda:4", {}, "device cuda:4: no such GPU (this host has 4 GPUs, 0..3)"),
        ("cuda:2", {"CUDA_VISIBLE_DEVICES": "2,3"}, "device cuda:2: no such GPU (2 visible under CUDA_VISIBLE_DEVICES=2,3)"),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "-1"}, "device cuda: no GPU is visible under CUDA_VISIBLE_DEVICES=-1"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "0,7"}, "CUDA_VISIBLE_DEVICES=0,7: GPU 7 does not exist (this host has 4 GPUs, 0..3)"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "1,1"}, f"CUDA_VISIBLE_DEVICES=1,1: GPU 1 ({fake_uuid(1)}) is listed twice"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "GPU-ffff"}, "CUDA_VISIBLE_DEVICES=GPU-ffff: GPU-ffff matches no GPU of this host"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "GPU-0000000"}, "CUDA_VISIBLE_DEVICES=GPU-0000000: GPU-0000000 matches 4 GPUs"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "MIG-1"}, "CUDA_VISIBLE_DEVICES=MIG-1: MIG-1 is a MIG instance"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "first"}, "CUDA_VISIBLE_DEVICES=first: 'first' is neither a GPU index nor a GPU UUID"),
    ],
)  # fmt: skip
def test_a_device_the_host_lacks_is_one_line_naming_what(
    host: FakeNvmlHost, device: str, environ: dict[str, str], problem: str
) -> None:
    with pytest.raises(PlacementError) as refused:
        indices(device, environ)
    assert str(refused.value).startswith(problem) and "\n" not in str(refused.value)


def test_without_nvml_auto_is_the_cpu_and_a_gpu_setting_is_refused() -> None:
    no_gpu = GpuSnapshot(False, "no NVIDIA GPU: NVML Shared Library Not Found", "", [])
    assert gpu_candidates("auto", no_gpu, {}) is None
    assert device_finding("cuda:0", no_gpu, "x/run.json", {}) == (
        False, "x/run.json: device cuda:0: no NVIDIA GPU: NVML Shared Library Not Found"
    )


def test_the_finding_says_which_gpu(host: FakeNvmlHost) -> None:
    snapshot = gpu_snapshot()
    assert device_finding("cuda:1", snapshot, environ={"CUDA_VISIBLE_DEVICES": "2,3"}) == (
        True, f"device cuda:1: GPU 3 ({fake_uuid(3)}), NVIDIA H200"
    )
    assert device_finding("auto", snapshot, environ={}) == (
        True, "device auto: the first of GPUs 0, 1, 2, 3 whose lease is free"
    )
    assert device_finding("cpu", snapshot, environ={}) == (True, "device cpu: the CPU")


def test_the_finding_names_the_one_gpu_there_is_to_take(host: FakeNvmlHost) -> None:
    # A README walk read "the first of GPUs 1 whose lease is free" with one GPU visible.
    snapshot = gpu_snapshot()
    assert device_finding("auto", snapshot, environ={"CUDA_VISIBLE_DEVICES": "1"}) == (
        True, "device auto: GPU 1, when its lease is free"
    )
    assert device_finding("cuda", snapshot, environ={"CUDA_VISIBLE_DEVICES": "3,1"}, degree=2) == (
        True, "device cuda: GPUs 3, 1, when their leases are free"
    )


def test_a_placed_process_sees_its_gpu_alone_by_uuid_as_cuda_0(host: FakeNvmlHost) -> None:
    gpu = gpu_candidates("cuda:1", gpu_snapshot(), {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert gpu is not None
    child = child_environment(gpu, {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin"})
    assert child == {"CUDA_VISIBLE_DEVICES": fake_uuid(3), "NSCONSOLE_GPUS": fake_uuid(3), "PATH": "/bin"}
    # What the placed trainer (or tune) then sees of the host: the one GPU, physical 3.
    assert indices("auto", child) == [3]
    assert placed_device("cuda:1", child) == "cuda:0" and placed_device("auto", child) == "cuda:0"
    assert placed_device("cpu", child) == "cpu"
    assert placed_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,3"}) == "cuda:1"  # not placed: as given


def test_leases_of_several_gpus_are_taken_all_or_none(host: FakeNvmlHost, tmp_path: Path) -> None:
    def leases(line: str) -> list[GpuLease]:
        return [GpuLease(index, tmp_path / line, fake_uuid(index)) for index in range(4)]

    other = GpuLease(1, tmp_path / "other", fake_uuid(1))
    assert other.try_acquire()
    pair = take_free_leases(leases("a"), count=2)
    assert pair is not None and [lease.index for lease in pair] == [0, 2]
    holder = lease_holder(2)
    assert holder is not None and (holder.line, holder.gpu, holder.uuid) == (str(tmp_path / "a"), 2, fake_uuid(2))
    # Only GPU 3 is free: a line that needs two holds none of them while it waits.
    assert take_free_leases(leases("b"), count=2) is None
    assert lease_holder(3) is None
    single = take_free_leases(leases("b"))
    assert single is not None and [lease.index for lease in single] == [3]
    for lease in [*pair, *single, other]:
        lease.release()
    assert all(lease_holder(index) is None for index in range(4))


def test_new_and_check_refuse_a_gpu_past_the_host_s(host: FakeNvmlHost, tmp_path: Path) -> None:
    data = make_data_line(tmp_path, files=1)
    with pytest.raises(LineError) as refused:
        new_line(tmp_path / "far", NewLineOptions(preset="transformer-tiny", data=data, device="cuda:4"))
    assert str(refused.value) == f"{tmp_path / 'far' / 'run.json'}: device cuda:4: no such GPU (this host has 4 GPUs, 0..3)"
    assert not (tmp_path / "far").exists()
    config = new_line(tmp_path / "near", NewLineOptions(preset="transformer-tiny", data=data, device="cuda:3"))
    assert config.device == "cuda:3" and RunConfig.load(tmp_path / "near" / "run.json").device == "cuda:3"

    line = make_line(tmp_path, data, device="cuda:9")
    _config, results = check_line(line, verify_checkpoints=False)
    failed = [result.message for result in results if not result.ok]
    assert failed == ["run.json: device cuda:9: no such GPU (this host has 4 GPUs, 0..3)"]


@pytest.mark.parametrize("device", ["cuda:", "gpu", "cpu:0", "cuda:-1", "CUDA:0"])
def test_run_json_takes_auto_cpu_cuda_or_cuda_n_only(device: str) -> None:
    document = {
        "model": {"preset": "pssa-1.5m"}, "data": {"line": "d"}, "lengths": [{"seq_len": 64}],
        "plan": [{"name": "a", "seq_len": 64, "tokens": None}], "device": device,
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"^x/run.json: device must be auto, cpu, cuda or cuda:N, got "):
        RunConfig.from_dict(document).validate(source="x/run.json")
    document["device"] = "cuda:12"
    RunConfig.from_dict(document).validate()


def test_cuda_n_at_a_degree_above_1_names_gpu_n_and_the_next_ones(host: FakeNvmlHost) -> None:
    snapshot = gpu_snapshot()
    two = gpu_candidates("cuda:2", snapshot, {}, degree=2)
    assert two is not None and [gpu.index for gpu in two] == [2, 3]
    auto = gpu_candidates("auto", snapshot, {}, degree=2)
    assert auto is not None and [gpu.index for gpu in auto] == [0, 1, 2, 3]  # the first 2 free of them
    with pytest.raises(PlacementError) as refused:
        gpu_candidates("cuda:3", snapshot, {}, degree=2)
    assert str(refused.value) == (
        "device cuda:3 at parallel.degree 2: its ranks need GPUs 3..4 (this host has 4 GPUs, 0..3)"
    )
    # Under CUDA_VISIBLE_DEVICES the ranks' GPUs are the entries after N's, as CUDA numbers them.
    visible = {"CUDA_VISIBLE_DEVICES": "3,1,0"}
    pair = gpu_candidates("cuda:1", snapshot, visible, degree=2)
    assert pair is not None and [gpu.index for gpu in pair] == [1, 0]
    assert device_finding("cuda:1", snapshot, environ=visible, degree=2) == (
        True, f"device cuda:1: GPU 1 ({fake_uuid(1)}), {pair[0].name}; GPU 0 ({fake_uuid(0)}), {pair[1].name}"
    )
    assert device_finding("auto", snapshot, environ=visible, degree=2) == (
        True, "device auto: the first 2 of GPUs 3, 1, 0 whose lease is free"
    )
    assert device_finding("cuda", snapshot, "x/run.json", environ={"CUDA_VISIBLE_DEVICES": "2"}, degree=2) == (
        False, "x/run.json: device cuda: parallel.degree 2 needs 2 GPUs, 1 visible"
    )


def test_new_and_check_refuse_ranks_past_the_host_s_gpus(host: FakeNvmlHost, tmp_path: Path) -> None:
    data = make_data_line(tmp_path, files=1)
    line = make_line(tmp_path, data, device="cuda:3", **{"parallel.degree": 2})
    _config, results = check_line(line, verify_checkpoints=False)
    failed = [result.message for result in results if not result.ok]
    assert failed == [
        "run.json: device cuda:3 at parallel.degree 2: its ranks need GPUs 3..4 (this host has 4 GPUs, 0..3)"
    ]
