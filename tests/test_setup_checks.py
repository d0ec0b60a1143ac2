"""The setup checks' decisions, on states recorded from real 2-rank jobs (tests/fixtures/setup, made by
tests/fixtures/setup/record.py from tests/scripts/setup_worker.py), and the rank-side pieces that
gather their facts (samplers, fingerprints, the ring's facts block)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, TensorDataset

from dtwatch.bundle.file_evidence import FileEvidence
from dtwatch.config import Config
from dtwatch.diagnose.rank_state import RankState
from dtwatch.diagnose.setup import (
    CHECKS,
    HOLD_S,
    SETTLE_S,
    Hold,
    config_divergence,
    drop_last_differs,
    same_data,
    same_device,
    same_shuffle,
    setup_warnings,
)
from dtwatch.record.data_samplers import describe_loader, training_now
from dtwatch.record.fingerprint import LEAF_BYTES, dataset_signature, fingerprint
from dtwatch.record.installation import Recorder
from dtwatch.record.setup_probe import EPOCHS_KEPT, FINGERPRINTS_KEPT, SetupFacts, _fit
from dtwatch.report.capture import load_fixture
from dtwatch.ring.layout import FACTS_CAPACITY, FACTS_END, FACTS_HEAD, FACTS_OFFSET
from dtwatch.ring.setup_facts import encode_facts, read_facts, write_facts
from dtwatch.watchdog.summary import decode_states, encode_states
from tests.harness import REPO, SCRIPTS, site_line

FIXTURES = Path(__file__).parent / "fixtures" / "setup"
WORKER = SCRIPTS / "setup_worker.py"
WORKER_FILE = "tests/scripts/setup_worker.py"


def recorded(name: str) -> tuple[list[RankState], float]:
    fx = load_fixture(FIXTURES / f"{name}.json")
    return fx.states, fx.now


# fixture -> (check, kind, ranks, marker of the line the warning names)
EXPECTED = {
    "not_distributed": ("not_distributed", "not_distributed", [0, 1], "alone_step"),
    "same_data_sequential": ("same_data", "same_data", [0, 1], "train_loop"),
    "same_data_iterable": ("same_data", "same_data", [0, 1], "train_loop"),
    "same_data_random": ("same_data", "same_data", [0, 1], "train_loop"),
    "sampler_rank": ("same_data", "same_data", [0, 1], "train_loop"),
    "same_shuffle": ("same_shuffle", "same_shuffle", [0, 1], "train_loop"),
    "drop_last": ("drop_last", "uneven_iterations", [1], "train_loop"),
    "config_divergence": ("config_divergence", "config_divergence", [1], "ddp_wrap"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recorded_mistake_gives_its_one_warning_with_ranks_and_line(name):
    states, now = recorded(name)
    check, kind, ranks, marker = EXPECTED[name]
    found = setup_warnings(states, now, FileEvidence())  # reads the worker script for the line
    assert [f.details["check"] for f in found] == [check], [f.summary for f in found]
    f = found[0]
    assert f.kind == kind and f.severity == "warning" and f.ranks == ranks and f.site is not None
    assert f.site["file"].endswith(WORKER_FILE) and f.site["line"] == site_line(marker, WORKER)
    assert f.site["source"]  # the line's text, shown with the warning


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_rank_on_another_node_carries_its_facts_through_the_exchange(name):
    """Rank 1 as another node's watchdog sees it (the exchange's compact state): the same warning, word
    for word, so a mistake whose ranks are on different nodes is still named."""
    states, now = recorded(name)
    remote = decode_states(encode_states("node-b", [states[1]], now)).states[0]
    assert remote.setup == states[1].setup
    local_only = setup_warnings([states[0], RankState.from_dict({**states[1].to_dict(), "setup": {}})], now)
    crossed = setup_warnings([states[0], remote], now)
    assert [f.to_dict() for f in crossed] == [f.to_dict() for f in setup_warnings(states, now)]
    assert [f.to_dict() for f in crossed] != [f.to_dict() for f in local_only]  # the facts decided it


def test_the_recorded_healthy_job_gives_no_warning():
    states, now = recorded("healthy")
    assert setup_warnings(states, now) == []
    # What kept it quiet was evidence, not missing facts: the evaluation loader is not training data, the
    # per-rank shard has its own data, the sampler's epoch moved, every rank has the same drop_last.
    loaders = [f for s in states for f in s.setup["loaders"].values()]
    assert len(loaders) == 6
    assert {f["train"] for f in loaders} == {True, False}
    shards = [f for f in loaders if f["sampler"] == "RandomSampler"]
    assert len({f["dsig"] for f in shards}) == 2 and len({json.dumps(f["fp"]) for f in shards}) == 2
    assert all(len({tuple(e) for e in f["epochs"]}) == 3 for f in loaders if f["dist"])


def test_which_same_data_evidence_names_the_cause():
    cases = {"same_data_sequential": ("first_batch", "SequentialSampler is not distributed"),
             "same_data_iterable": ("first_batch", "IterableDataset is not split by rank"),
             "same_data_random": ("dataset", "RandomSampler, which is not distributed"),
             "sampler_rank": ("sampler_rank", "built with rank=0 (num_replicas=2)")}
    for name, (evidence, words) in cases.items():
        f = same_data(*recorded(name))
        assert f is not None and f.details["evidence"] == evidence and words in f.summary, (name, f)


def test_not_distributed_names_the_world_and_the_step_line():
    f = setup_warnings(*recorded("not_distributed"), FileEvidence())[0]  # the step line read from the script
    assert "WORLD_SIZE=2" in f.summary and "without a process group" in f.summary
    assert "opt.step()" in f.summary and f.details["world"] == 2
    assert all(n >= 1 for n in f.details["steps"].values())


def test_config_divergence_names_the_deviant_and_both_values():
    f = setup_warnings(*recorded("config_divergence"))[0]
    assert "161 on rank 0; 181 on rank 1" in f.summary
    assert [d["values"] for d in f.details["differences"]] == [{"0": 161, "1": 181}]


# ---------------------------------------------------------------------------------------------------
# decisions on recorded states, changed the way a mistake would change them
# ---------------------------------------------------------------------------------------------------
def healthy() -> tuple[list[RankState], float]:
    states, now = recorded("healthy")
    return copy.deepcopy(states), now


def put_device(s: RankState, **device) -> None:
    s.setup["device"] = {"type": "cuda", "index": 0, "uuid": "", "how": "set_device",
                         "site": {"file": "train.py", "line": 12, "function": "main"}, **device}


def test_same_device_when_two_local_ranks_share_a_gpu_uuid():
    states, now = healthy()
    put_device(states[0], index=0, uuid="GPU-aaaa")
    put_device(states[1], index=0, uuid="GPU-aaaa")
    f = same_device(states, now)
    assert f is not None and f.ranks == [0, 1] and f.kind == "same_device"
    assert "cuda:0 (GPU-aaaa)" in f.summary and "LOCAL_RANK" in f.summary
    assert f.site == {"file": "train.py", "line": 12, "function": "main"}  # no evidence given: no source text


def test_same_device_is_quiet_for_distinct_gpus_cpu_and_other_hosts():
    states, now = healthy()
    put_device(states[0], index=0, uuid="GPU-aaaa")
    put_device(states[1], index=1, uuid="GPU-bbbb")
    assert same_device(states, now) is None
    # Each rank restricted to its own GPU by CUDA_VISIBLE_DEVICES sees it as index 0: not the same GPU.
    put_device(states[0], index=0)
    put_device(states[1], index=0)
    states[0].setup["cvd"], states[1].setup["cvd"] = "0", "1"
    assert same_device(states, now) is None
    states[1].setup["cvd"] = "0"
    assert same_device(states, now) is not None
    states[1].host = "other-node"
    assert same_device(states, now) is None
    assert same_device(*healthy()) is None  # CPU ranks record no device


def test_same_device_tells_idle_gpus_only_when_the_ranks_saw_them_and_is_quiet_when_sharing_is_meant():
    states, now = healthy()
    put_device(states[0], uuid="GPU-aaaa", count=8)
    put_device(states[1], uuid="GPU-aaaa", count=8)
    f = same_device(states, now)
    assert "7 other GPU(s) they can see stay idle" in f.summary and "LOCAL_RANK" in f.summary
    # One GPU on the host: no GPU stands idle, and binding to LOCAL_RANK cannot help.
    put_device(states[0], uuid="GPU-aaaa", count=1)
    put_device(states[1], uuid="GPU-aaaa", count=1)
    f = same_device(states, now)
    assert "idle" not in f.summary and "sees only 1 GPU" in f.summary and "--nproc-per-node" in f.summary
    # Unknown count (an older ring): no claim about other GPUs.
    put_device(states[0], uuid="GPU-aaaa")
    put_device(states[1], uuid="GPU-aaaa")
    assert "idle" not in same_device(states, now).summary
    # Sharing on purpose (NCCL >= 2.30's switch, or one NCCL_HOSTID per rank): nothing to warn about.
    for sh in ({"multi_rank": "1"}, {"multi_rank": "1"}), ({"hostid": "a"}, {"hostid": "b"}):
        states[0].setup["gpu_share"], states[1].setup["gpu_share"] = sh
        assert same_device(states, now) is None, sh
    # ...but only when every rank on that GPU says so (one NCCL_HOSTID shared by both is no workaround).
    states[0].setup["gpu_share"], states[1].setup["gpu_share"] = {"hostid": "a"}, {"hostid": "a"}
    assert same_device(states, now) is not None
    states[0].setup["gpu_share"], states[1].setup["gpu_share"] = {"multi_rank": "1"}, {}
    assert same_device(states, now) is not None


def test_same_shuffle_needs_an_epoch_that_never_moved():
    states, now = healthy()
    assert same_shuffle(states, now) is None
    for s in states:
        for f in s.setup["loaders"].values():
            if f["dist"]:
                f["epochs"] = [[0, 0]] * len(f["epochs"])
    f = same_shuffle(states, now)
    assert f is not None and f.ranks == [0, 1] and "set_epoch" in f.summary
    for s in states:  # an evaluation loader (grad off or models in eval mode): its order harms nobody
        for ld in s.setup["loaders"].values():
            ld["train"] = False
    assert same_shuffle(states, now) is None
    for s in states:  # shuffle=False: the same order every epoch is what was asked for
        for ld in s.setup["loaders"].values():
            ld["train"], ld["shuffle"] = True, False
    assert same_shuffle(states, now) is None


def peeked_before_set_epoch(peek_epochs: list[int], loop_epochs: list[int]) -> tuple[list[RankState], float]:
    """The healthy job's sampler, iterated at two lines as the DDP tutorial does: ``next(iter(loader))``
    to read the batch size at each epoch's start, before ``set_epoch``, then the loop after it."""
    states, now = healthy()
    for s in states:
        loop = s.setup["loaders"]["0"]
        loop["sid"] = 140000000 + s.rank
        peek = copy.deepcopy(loop)
        peek["epochs"], peek["iters"] = [[0, e] for e in peek_epochs], len(peek_epochs)
        loop["epochs"], loop["iters"] = [[0, e] for e in loop_epochs], len(loop_epochs)
        s.setup["loaders"]["3"] = peek
        s.loaders.append({**s.loaders[0], "index": 3, "site": {**s.loaders[0]["site"], "line": 99}})
    return states, now


def test_same_shuffle_judges_a_sampler_over_every_line_that_iterates_it():
    # The peek sees the previous epoch at each epoch's start: alone it looks stuck, with its loop it is not.
    assert same_shuffle(*peeked_before_set_epoch([0, 0], [0, 1])) is None
    assert same_shuffle(*peeked_before_set_epoch([0, 0, 1, 2], [0, 1, 2, 3])) is None
    # Between the peek and the loop of the second epoch (the loop seen once): no verdict yet.
    assert same_shuffle(*peeked_before_set_epoch([0, 0], [0])) is None
    # set_epoch never called: both lines stay at epoch 0.
    f = same_shuffle(*peeked_before_set_epoch([0, 0], [0, 0]))
    assert f is not None and f.ranks == [0, 1] and "set_epoch" in f.summary


def test_a_sampler_left_alone_beside_one_that_moves_is_not_a_forgotten_set_epoch():
    # minGPT's trainer calls set_epoch on the training sampler only; the test loader's shuffling sampler stays
    # at epoch 0, and its loop starts with gradients on (set_grad_enabled wraps each batch, not the loop).
    states, now = healthy()
    for s in states:
        train = s.setup["loaders"]["0"]
        train["sid"], train["epochs"] = 1, [[0, 0], [0, 1]]
        stuck = copy.deepcopy(train)
        stuck["sid"], stuck["epochs"] = 2, [[0, 0], [0, 0]]
        s.setup["loaders"]["9"] = stuck
    assert same_shuffle(states, now) is None
    for s in states:  # the training sampler stuck too: set_epoch is never called
        s.setup["loaders"]["0"]["epochs"] = [[0, 0], [0, 0]]
    f = same_shuffle(states, now)
    assert f is not None and f.ranks == [0, 1]


def test_loaders_behind_one_library_line_are_compared_per_users_line():
    # Accelerate iterates every loader at one line of its own: rank 0 alone evaluating (4 batches) while
    # the others train (16) is not a loader of different lengths.
    from dtwatch.diagnose.loaders import uneven_loader_warnings

    states, now = healthy()
    lib = {"file": "/venv/lib/python3.11/site-packages/accelerate/data_loader.py", "line": 583,
           "function": "__iter__"}

    def loader(index: int, length: int, user_line: int) -> dict:
        return {"index": index, "site": lib, "length": length, "epochs": 1, "time": now, "step": 0,
                "user_site": {"file": "train.py", "line": user_line, "function": "main"}}

    for s in states:
        s.loaders = [loader(0, 16, 22)]
    states[0].loaders.append(loader(1, 4, 29))
    assert uneven_loader_warnings(states, now) == []
    states[1].loaders[0]["length"] = 12
    (w,) = uneven_loader_warnings(states, now)
    assert w.ranks == [1] and "train.py:22" in w.summary and "(iterated in " in w.summary


def test_drop_last_differing_on_one_rank_is_an_uneven_iterations_warning():
    states, now = healthy()
    assert drop_last_differs(states, now) is None
    dist_loader = next(k for k, f in states[0].setup["loaders"].items() if f["dist"])
    states[0].setup["loaders"][dist_loader]["drop_last"] = [False, False]
    f = drop_last_differs(states, now)
    assert f is not None and f.kind == "uneven_iterations" and f.ranks == [1]
    assert f.details["drop_last"] == {"0": [False, False], "1": [True, True]}


def test_evaluation_loaders_are_not_compared():
    states, now = healthy()
    for s in states:  # the same first batch on both ranks, but in an evaluation epoch (no grad)
        for f in s.setup["loaders"].values():
            if not f["train"]:
                f["fp"] = {"1": "feedfacefeedface"}
    assert same_data(states, now) is None
    for s in states:
        for f in s.setup["loaders"].values():
            f["train"] = True
    assert same_data(states, now) is not None


def test_config_divergence_waits_until_the_wraps_settle():
    states, now = healthy()
    states[1].setup["torch"] = "2.9.0"
    for s in states:
        s.step = 0
        for w in s.setup["wraps"]:
            w["t"] = now - 1.0  # still wrapping, nobody stepped
    assert config_divergence(states, now) is None
    f = config_divergence(states, now + SETTLE_S)
    assert f is not None and f.ranks == [1] and "the torch version" in f.summary


def test_config_divergence_names_the_minority_among_many_ranks():
    states, now = healthy()
    template = states[1]
    for rank in (2, 3):
        s = copy.deepcopy(template)
        s.rank = rank
        states.append(s)
    states[2].setup["wraps"][0]["policy"] = "param=bfloat16"
    f = config_divergence(states, now)
    assert f is not None and f.ranks == [2]
    assert "the mixed-precision policy of the model wrapped by DDP" in f.summary
    assert "(none on ranks 0-1,3; param=bfloat16 on rank 2)" in f.summary


def test_states_without_setup_facts_give_no_warning():
    # Incidents recorded before the facts block existed: nothing to compare, nothing said.
    without = 0
    for path in sorted((REPO / "tests" / "incidents").glob("*.json")):
        fx = load_fixture(path)
        if any(s.setup for s in fx.states):
            continue
        without += 1
        assert setup_warnings(fx.states, fx.now) == [], path.name
    assert without >= 40


def test_recorded_incidents_with_setup_facts_warn_only_where_it_is_true():
    # uneven_ddp_loader seeds every rank alike and uses no DistributedSampler: every rank's first batch is
    # the same, as the warning says; the other recaptured scenarios shard their data or use none.
    said = {}
    for path in sorted((REPO / "tests" / "incidents").glob("*.json")):
        fx = load_fixture(path)
        if any(s.setup for s in fx.states):
            said[path.stem] = sorted(f.kind for f in setup_warnings(fx.states, fx.now))
    assert said.pop("uneven_ddp_loader", None) in (["same_data"], None)
    assert all(kinds == [] for kinds in said.values()), said


# ---------------------------------------------------------------------------------------------------
# rank-side pieces
# ---------------------------------------------------------------------------------------------------
def test_facts_block_round_trip_and_a_torn_write_reads_as_none():
    buf = bytearray(FACTS_END)
    doc = {"v": 1, "torch": "2.13.0", "loaders": {"0": {"fp": {"1": "ab"}}}}
    assert write_facts(buf, encode_facts(doc))
    assert read_facts(bytes(buf)) == doc
    buf[FACTS_OFFSET + FACTS_HEAD.size + 3] ^= 0xFF  # a reader caught mid-write
    assert read_facts(bytes(buf)) == {}
    assert read_facts(bytes(FACTS_END)) == {}  # a ring written before the block existed
    assert not write_facts(buf, b"x" * (FACTS_CAPACITY + 1))


def test_an_oversized_document_is_trimmed_to_fit():
    loaders = {str(i): {"sampler": "DistributedSampler" * 4, "fp": {str(e): "f" * 16 for e in range(3)}}
               for i in range(60)}
    payload = _fit({"v": 1, "torch": "2.13.0", "world": 8, "wraps": [], "loaders": loaders})
    assert len(payload) <= FACTS_CAPACITY
    doc = json.loads(payload)
    assert doc["truncated"] and "0" in doc["loaders"] and len(doc["loaders"]["0"]["fp"]) == 1


def test_fingerprints_follow_the_content_within_their_bound():
    a = (torch.arange(1000.0).reshape(10, 100), torch.arange(10))
    assert fingerprint(a) == fingerprint(tuple(t.clone() for t in a))
    assert fingerprint(a) != fingerprint((a[0] + 1, a[1]))
    assert fingerprint({"x": a[0], "text": ["a", "b"]}) != fingerprint({"x": a[0], "text": ["a", "c"]})
    # Bounded: only the leading LEAF_BYTES of a tensor are read.
    big = torch.zeros(LEAF_BYTES)  # 4 bytes per element
    changed = big.clone()
    changed[-1] = 1.0
    assert fingerprint(big) == fingerprint(changed)
    assert fingerprint(object()) is None  # nothing readable: no claim either way


def test_dataset_signature_only_for_content_readable_without_user_code():
    data = TensorDataset(torch.ones(8, 2))
    assert dataset_signature(data) == dataset_signature(TensorDataset(torch.ones(8, 2)))
    assert dataset_signature(data) != dataset_signature(TensorDataset(torch.zeros(8, 2)))
    assert dataset_signature(torch.utils.data.Subset(data, [0, 1])) is not None
    assert dataset_signature(list(range(8))) is None


class Shard:
    """A batch sampler that serves one process's share, as Accelerate's shards do."""

    def __init__(self, inner, num_processes, process_index):
        self.batch_sampler, self.num_processes, self.process_index = inner, num_processes, process_index

    def __iter__(self):
        return iter(self.batch_sampler)

    def __len__(self):
        return len(self.batch_sampler)


def test_describe_loader_tells_distributed_samplers_from_the_rest():
    data = TensorDataset(torch.randn(16, 2))
    f = describe_loader(DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=3, seed=5),
                                   drop_last=True), True)
    assert (f["dist"], f["srank"], f["sreplicas"], f["shuffle"], f["seed"], f["epoch"]) == (True, 3, 4, True, 5, 0)
    assert f["drop_last"] == [True, False] and f["dlen"] == 16
    f = describe_loader(DataLoader(data, shuffle=True), True)
    assert (f["dist"], f["sampler"], f["shuffle"]) == (False, "RandomSampler", True)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    f = describe_loader(DataLoader(Stream()), False)
    assert f["dist"] is None and f["iterable"] and f["dlen"] == -1 and f["train"] is False
    inner = BatchSampler(torch.utils.data.SequentialSampler(data), 4, False)
    f = describe_loader(DataLoader(data, batch_sampler=Shard(inner, 2, 1)), True)
    assert (f["dist"], f["srank"], f["sreplicas"], f["sampler"]) == (True, 1, 2, "Shard")


def test_training_now_reads_grad_mode_and_the_wrapped_models():
    model = torch.nn.Linear(2, 2)
    assert training_now([model])
    with torch.no_grad():
        assert not training_now([model])
    model.eval()
    assert not training_now([model])


def test_checks_cli_lists_every_check_with_its_costs():
    out = subprocess.run([sys.executable, "-m", "dtwatch", "checks", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [c["name"] for c in doc["checks"]] == [c.name for c in CHECKS] == [
        "not_distributed", "same_device", "same_data", "same_shuffle", "drop_last", "config_divergence"]
    for c in doc["checks"]:
        assert c["kind"] and c["rank_cost"] and c["watchdog_cost"] and c["opt_out"]
    assert "DTWATCH_BATCH_FINGERPRINT=0" in doc["checks"][2]["opt_out"]


def unattached_facts(tmp_path, **options) -> SetupFacts:
    """The setup facts of a real recorder that has no ring yet (no process group): kept in memory."""
    return SetupFacts(Recorder(Config(dir=str(tmp_path), job_id="facts", watchdog="off", **options)))


def test_a_loader_epoch_notes_the_sampler_and_fingerprints_its_first_batch_in_the_first_epochs(tmp_path):
    facts = unattached_facts(tmp_path)
    data = TensorDataset(torch.arange(64.0).reshape(32, 2))
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=2, rank=1)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    for epoch in range(1, 7):
        sampler.set_epoch(epoch)
        it = facts.loader_epoch(loader, 0, iter(loader))
        # The first epochs' first batches are fingerprinted; later epochs cost the attribute reads only.
        assert ("_next_data" in it.__dict__) == (epoch <= FINGERPRINTS_KEPT)
        next(it)
        assert "_next_data" not in it.__dict__  # later batches go straight to torch
        assert len(list(it)) == 3
    assert facts.worker.drain()
    entry = facts.doc["loaders"]["0"]
    assert (entry["iters"], entry["srank"]) == (6, 1)
    assert entry["epochs"] == [[0, e] for e in range(1, EPOCHS_KEPT + 1)]
    assert list(entry["fp"]) == ["1", "2", "3"] and entry["fp"]["1"] != entry["fp"]["2"]  # reshuffled
    # A change of what the loader says is noted in any epoch (a loader made again at the same line).
    again = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    facts.loader_epoch(again, 0, iter(again))
    assert facts.doc["loaders"]["0"]["drop_last"] == [True, False] and facts.doc["loaders"]["0"]["iters"] == 7
    facts.close()


def test_batch_fingerprints_can_be_turned_off(tmp_path):
    facts = unattached_facts(tmp_path, batch_fingerprint=False)
    loader = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=4)
    it = facts.loader_epoch(loader, 0, iter(loader))
    assert "_next_data" not in it.__dict__ and len(list(it)) == 2
    assert facts.worker.drain()
    assert facts.doc["fp_off"] and facts.doc["loaders"]["0"]["fp"] == {}
    facts.close()


def test_a_weaker_device_fact_never_replaces_a_stronger_one(tmp_path):
    facts = unattached_facts(tmp_path)
    site = {"file": "train.py", "line": 30, "function": "main"}
    facts.set_device({"type": "cuda", "index": 0, "uuid": "GPU-a"}, "current", None)
    facts.set_device({"type": "cuda", "index": 1, "uuid": "GPU-b"}, "wrap", site)
    facts.set_device({"type": "cuda", "index": 0, "uuid": "GPU-a"}, "set_device", None)  # e.g. a later call
    assert facts.doc["device"] == {"type": "cuda", "index": 1, "uuid": "GPU-b", "how": "wrap", "site": site}
    facts.close()


def test_a_live_warning_waits_for_the_ranks_a_moment_behind():
    states, now = recorded("not_distributed")
    first_only = [s for s in states if s.rank == 1]  # rank 0 made its ring a moment later
    hold = Hold()
    assert hold.due(setup_warnings(first_only, now), now, 2) == []
    assert hold.due(setup_warnings(states, now + 1.0), now + 1.0, 2)[0].ranks == [0, 1]  # every rank: at once
    late = Hold()
    late.due(setup_warnings(first_only, now), now, 2)
    assert late.due(setup_warnings(first_only, now + HOLD_S), now + HOLD_S, 2)[0].ranks == [1]  # not forever
    # Every rank's facts compared: a warning naming one deviant is due at once.
    states, now = recorded("drop_last")
    due = Hold().due(setup_warnings(states, now), now, 2)
    assert [(f.ranks, f.details["compared"]) for f in due] == [([1], [0, 1])]
