"""The specs of the katas that write a training's state and load it back (k15's checkpoints, k16's
snapshots): what they hold the learner to in common, said in each kata's words.

Words(file, writer, loader, unit)      how a kata names its file, its two functions, what it counts
run_checked(fn, world_size, ...)       run_world; a hang and a failed load told in the kata's words
load_failure(failure, ..., words)      what a failed load_state_dict in a rank means, or None
read_file(path)                        what a file holds, on the CPU (None where there is none)
trained_file(path, model, optimizer, batches, **fields)  a real file, without the learner's code
wrapped_model(kata, seed, optimizer)   a rank's model, the kata's wrapper and optimizer
states_after(model, optimizer)         a rank's model and optimizer states, and where they live
check_one_writer(results, words)       global rank 0 alone wrote the file
check_holds_the_parts(on_disk, ...)    the file is a dict of the parts, the model's unwrapped
check_loaded_weights(results, rank, expected, words)  a rank loaded the file into its own model
check_loaded_onto_own_device(results, words)          with map_location, onto its own device
check_refuses(path, bare, lacking, words, ...)        the loader refuses a file lacking parts
train_noting(kata, words, folder, rank, train)        the kata's training, its moments noted
read_notes(folder, rank)               what a rank's training noted
check_count(rank, events, words, run)  every write counted the units trained, not an index
written_after(events)                  how many units had been trained at each write
check_same_run(whole, resumed, ...)    a restarted run ends as the uninterrupted one, bit for bit
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

from dojo.harness.world import RankFailed, WorldDeadlock, run_world
from dojo.spec.states import devices_of, largest_gap, same, to_cpu
from dojo.spec.testing import assert_refuses_missing_keys, outcome_of, ranks_phrase


@dataclass(frozen=True)
class Words:
    """How a kata names things: k15 writes a "checkpoint" with "save_checkpoint", loads it with
    "load_checkpoint" and counts a "step"; k16 a "snapshot", "write_snapshot", "load_snapshot",
    an "epoch"."""

    file: str
    writer: str
    loader: str
    unit: str

    @property
    def write(self) -> str:
        """The writer's verb: "save", "write"."""
        return self.writer.split("_")[0]


def run_checked(
    fn, world_size: int, *args, words: Words, hang, written_by_the_test: bool, **options
):
    """``run_world(fn, world_size, *args, **options)``: a deadlock raises ``hang(failure)`` (the
    kata's AssertionError), a failed load_state_dict what ``load_failure`` says of it."""
    try:
        return run_world(fn, world_size, *args, **options)
    except WorldDeadlock as failure:
        raise hang(failure) from None
    except RankFailed as failure:
        raise load_failure(failure, written_by_the_test, words) or failure from None


_LOADING = re.compile(r"Error\(s\) in loading state_dict for (\w+)")
_KEYS = re.compile(r'(Missing|Unexpected) key\(s\) in state_dict: ((?:"[^"]*"(?:, )?)+)')


def load_failure(
    failure: BaseException, written_by_the_test: bool, words: Words
) -> AssertionError | None:
    """What a failed load_state_dict in a rank means, read from torch's own words: the model's
    keys loaded into the DDP wrapper (whose keys all start with 'module.'), or a file that lacks
    some of the model's state; None when the failure is something else. (Never from a 'module.'
    anywhere in the text: every traceback through torch/nn/modules/module.py has one.)"""
    text = str(failure)
    loading = _LOADING.search(text)
    if loading is None:
        return None
    into = loading.group(1)
    keys = {kind: re.findall(r'"([^"]*)"', listed) for kind, listed in _KEYS.findall(text)}
    missing, unexpected = keys.get("Missing", []), keys.get("Unexpected", [])
    file = words.file
    if into == "DistributedDataParallel" or (
        missing and all(key.startswith("module.") for key in missing)
    ):
        return AssertionError(
            f"{words.loader} loaded the model's state_dict into the DDP wrapper, whose keys all "
            "start with 'module.', so none matched. Load it into the model inside the wrapper "
            f"(model.module), which is what the {file} holds.\n\n{text}"
        )
    if not missing and not unexpected:
        return None
    found = (
        f"the {file} lacks {missing}, which {into} has"
        if missing
        else f"the {file} holds {unexpected}, which {into} does not have"
    )
    if written_by_the_test:  # the test's file is whole: the load changed it
        cure = (
            f"the test wrote this {file} from the whole state_dict: hand load_state_dict "
            f"the {file}'s 'model' as it is, into the model inside the wrapper (model.module)"
        )
    else:
        cure = (
            f"the {file} was written by {words.writer}: save the model's whole state_dict, "
            "model.module.state_dict(). A tied weight is in it under each of its names and a "
            "buffer is in it too, while named_parameters() lists a shared parameter once and "
            "no buffer at all"
        )
    return AssertionError(f"{words.loader}'s load_state_dict found that {found}: {cure}.\n\n{text}")


def read_file(path) -> object:
    """What ``torch.save`` wrote at ``path``, loaded onto the CPU; None where there is no file."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def trained_file(path, model, optimizer, batches, **fields) -> dict:
    """A real file, made without the learner's code: ``model`` trained by ``optimizer`` on each
    of ``batches``, then its state_dict, the optimizer's and ``fields`` saved at ``path``. Returns
    what it saved, on the CPU."""
    from dojo.toy_models import loss

    device = next(model.parameters()).device
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss(model, (inputs.to(device), targets.to(device))).backward()
        optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **fields}
    torch.save(saved, path)
    return to_cpu(saved)


def wrapped_model(kata, seed: int, optimizer) -> tuple:
    """Inside a rank: ``(model, wrapped, optimizer)``, the toy "frozen" model seeded ``seed`` on
    the rank's device, the kata's wrapper around it and ``optimizer(kata, model)``."""
    from dojo.devices import rank_device
    from dojo.toy_models import make_model

    model = make_model("frozen", seed).to(rank_device())
    return model, kata.wrap(model), optimizer(kata, model)


def states_after(model, optimizer) -> dict:
    """Inside a rank: its model's and optimizer's states on the CPU, the devices they live on,
    and the rank's own device."""
    from dojo.devices import rank_device

    return {
        "state": to_cpu(model.state_dict()),
        "optimizer": to_cpu(optimizer.state_dict()),
        "devices": sorted(devices_of(model.state_dict()) | devices_of(optimizer.state_dict())),
        "device": str(rank_device()),
    }


def check_one_writer(results: list, words: Words) -> None:
    """Global rank 0 alone called torch.save (``results[rank]["saves"]``) in a world laid out as
    2 nodes x 2 ranks."""
    writers = [rank for rank, result in enumerate(results) if result["saves"]]
    assert writers, (
        f"no rank called torch.save in {words.writer}: global rank 0 must write the {words.file}"
    )
    if writers == [0, 2]:
        raise AssertionError(
            f"ranks 0 and 2 both wrote the {words.file}. This world is 2 nodes x 2 ranks: ranks 0 "
            "and 2 are each LOCAL_RANK 0 of their node, and on a shared file system both write the "
            "same file. Decide by the global rank, dist.get_rank() == 0: one writer for the whole "
            "job."
        )
    assert writers == [0], (
        f"{ranks_phrase(writers)} wrote the {words.file}: only global rank 0 may "
        "(dist.get_rank() == 0). The replicas are identical, so one copy is enough, and ranks "
        "that write one file at once can leave it torn."
    )


def check_holds_the_parts(on_disk, keys, words: Words, optimizer_state: str) -> None:
    """The file holds a dict with ``keys``, the optimizer's state among them (``optimizer_state``
    says in a sentence why it matters), and the model's own state_dict, not its DDP wrapper's."""
    file = words.file
    assert on_disk is not None, f"{words.writer} left no file at the path it was given"
    assert isinstance(on_disk, dict), (
        f"the {file} holds a {type(on_disk).__name__}: save a dict with the keys {keys}"
    )
    missing = [key for key in keys if key not in on_disk]
    if "optimizer" in missing and "model" in on_disk:
        raise AssertionError(
            f"the {file} holds the model but not the optimizer: {optimizer_state}. Save "
            "optimizer.state_dict() under 'optimizer'."
        )
    assert not missing, (
        f"the {file} has the keys {sorted(on_disk)}; it lacks {missing}: save {{'model': the "
        f"model's state_dict, 'optimizer': the optimizer's, '{words.unit}': {words.unit}}}"
    )
    wrapped = [name for name in on_disk["model"] if name.startswith("module.")]
    if wrapped:
        raise AssertionError(
            f"the {file}'s model keys start with 'module.' ({wrapped[0]!r}): that is the "
            "state_dict of torch's DDP wrapper, which a plain model cannot load. Save the "
            "state_dict of the model inside it, model.module.state_dict()."
        )


def check_loaded_weights(results: list, rank: int, expected: dict, words: Words) -> None:
    """Rank ``rank``'s model (``results[rank]["state"]``) holds the file's weights, ``expected``."""
    if same(results[rank]["state"], expected):
        return
    name, gap = largest_gap(results[rank]["state"], expected)
    loaded = [r for r in range(len(results)) if same(results[r]["state"], expected)]
    also = f" ({ranks_phrase(loaded)} did)" if loaded else ""
    raise AssertionError(
        f"after {words.loader} rank {rank}'s weights are not the {words.file}'s ({name!r} is up "
        f"to {gap:.3g} away){also}: every rank loads the {words.file} into its own model, not "
        "rank 0 alone (nothing copies rank 0's weights to the others afterwards)"
    )


def check_loaded_onto_own_device(results: list, words: Words) -> None:
    """Every rank read the file with torch.load and a map_location (``results[rank]["loads"]``),
    and its model and optimizer hold tensors on its own device only."""
    for rank, result in enumerate(results):
        assert result["loads"], (
            f"rank {rank}'s {words.loader} never called torch.load: read the {words.file} with "
            "torch.load(path, map_location=...)"
        )
        if not all(entry["given"] for entry in result["loads"]):
            raise AssertionError(
                f"rank {rank} called torch.load without map_location. torch.save remembered the "
                "device of every tensor (rank 0's cuda:0 on GPUs): without map_location every rank "
                "loads onto GPU 0, which then holds a copy per rank (or the load fails where there "
                "is no such GPU). Pass map_location=this rank's device (the device of the model's "
                "parameters) or 'cpu'."
            )
        stray = [d for d in result["devices"] if d != result["device"]]
        assert not stray, (
            f"after {words.loader} rank {rank}'s model or optimizer holds tensors on {stray}, "
            f"expected {result['device']}"
        )


def check_refuses(path, bare: bool, lacking, words: Words, kata: str, optimizer) -> None:
    """The loader refuses, with a ValueError naming the keys in ``lacking``, a file that is a bare
    state_dict (``bare``: torch.save(model.state_dict(), path), a common sight) or else one without
    its optimizer. ``optimizer(kata, model)`` makes the kata's optimizer (a module-level function:
    the load runs in a rank)."""
    from dojo.toy_models import make_model

    weights = make_model("frozen", 0).state_dict()
    torch.save(weights if bare else {"model": weights, words.unit: 3}, path)
    [(outcome, message)] = run_world(_refusal, 1, str(path), kata, words.loader, optimizer)
    assert_refuses_missing_keys(words.loader, outcome, message, lacking)


def _refusal(rank, world_size, path, name, loader, optimizer):
    from dojo.harness.impl import load_kata
    from dojo.toy_models import make_model

    kata = load_kata(name)
    model = make_model("frozen", 0)
    load = getattr(kata, loader)
    return outcome_of(lambda: load(path, kata.wrap(model), optimizer(kata, model)))


def train_noting(kata, words: Words, folder: str, rank: int, train):
    """``train()``, the kata's training, with every unit it trains, every file it writes and every
    load noted in ``folder`` as it happens (a rank that hangs or is killed loses its return
    value, not its notes): ``{"event": unit, unit: index}``, ``{"event": "write", unit: count,
    "done": units trained so far}`` and ``{"event": "load", unit: count, "found": whether the
    file was there}``. The kata's Run, writer and loader are its own again afterwards."""
    notes = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1)
    done = 0

    def note(**event):
        notes.write(json.dumps(event) + "\n")

    originals = {name: getattr(kata, name) for name in (words.writer, words.loader, "Run")}

    def unit(self, model, optimizer, index):
        nonlocal done
        value = getattr(originals["Run"], words.unit)(self, model, optimizer, index)
        done += 1
        note(event=words.unit, **{words.unit: index})
        return value

    def write(path, model, optimizer, count):
        note(event="write", **{words.unit: count}, done=done)
        originals[words.writer](path, model, optimizer, count)

    def load(path, model, optimizer):
        count = originals[words.loader](path, model, optimizer)
        note(event="load", **{words.unit: count}, found=os.path.exists(path))
        return count

    setattr(kata, words.writer, write)
    setattr(kata, words.loader, load)
    kata.Run = type("Run", (originals["Run"],), {words.unit: unit})
    try:
        return train()
    finally:
        for name, original in originals.items():
            setattr(kata, name, original)
        notes.close()


def read_notes(folder: str, rank: int) -> list[dict]:
    """What ``train_noting`` noted of rank ``rank``'s training, in order."""
    path = os.path.join(folder, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def check_count(rank: int, events: list[dict], words: Words, run: str) -> None:
    """Every file rank ``rank`` wrote in ``run`` ("the crashed run") counts the units trained
    before it, not the index of the last one (what ``train_noting`` noted: ``events``)."""
    unit = words.unit
    wrong = next((e for e in events if e["event"] == "write" and e[unit] != e["done"]), None)
    if wrong is not None:
        raise AssertionError(
            f"in {run}, rank {rank} called {words.writer} after {_count(wrong['done'], unit)} "
            f"with {unit}={wrong[unit]}: pass the count of {unit}s done ({unit} + 1), which is "
            f"where a restart goes on from, not the index of the last {unit}"
        )


def written_after(events: list[dict]) -> list[int]:
    """How many units had been trained at each write (what ``train_noting`` noted)."""
    return [e["done"] for e in events if e["event"] == "write"]


def _count(number: int, unit: str) -> str:
    return f"{number} {unit}" if number == 1 else f"{number} {unit}s"


def check_same_run(whole: list, resumed: list, words: Words, optimizer_part, kept: str) -> None:
    """Every rank ends the restarted run as the uninterrupted one: its weights bit for bit, then
    ``optimizer_part`` of its optimizer's state_dict (``kept``: what that part is, "its Adam
    state")."""
    for rank, (a, b) in enumerate(zip(whole, resumed)):
        if not same(a["state"], b["state"]):
            name, gap = largest_gap(b["state"], a["state"])
            raise AssertionError(
                f"after the restart rank {rank}'s weights differ from the uninterrupted run's "
                f"({name!r} by up to {gap:.3g}): a resumed run must be the same run, bit for bit"
            )
        if not same(optimizer_part(a["optimizer"]), optimizer_part(b["optimizer"])):
            raise AssertionError(
                f"after the restart rank {rank}'s weights equal the uninterrupted run's but {kept} "
                f"does not: {words.write} and load the optimizer's state too"
            )
