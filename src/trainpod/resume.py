"""``{resume:DIR}`` in a job's command: the newest *complete* checkpoint a script wrote itself.

An unmodified framework script is told where to resume by its own command-line flag
(Hugging Face's ``--resume_from_checkpoint``, accelerate examples' ``--resume_from_checkpoint``,
LightningCLI's ``--ckpt_path``). A job's command may hold the placeholder in one argument,
``--resume_from_checkpoint={resume:out}``; when the agent starts a rank it replaces the
placeholder with the newest complete checkpoint under ``DIR`` (relative to the job's working
directory, as the script sees it) or, when there is none (the first attempt), leaves the whole
argument out, so the script starts from scratch as it would without the flag. ADR 0030.

A checkpoint is an entry of ``DIR`` named ``<prefix>-<N>`` or ``<prefix>_<N>`` (HF's
``checkpoint-20``, ``step_20``); the newest is the highest ``N`` that is complete
(:func:`incomplete` says why one is not). A kill while a checkpoint is written leaves a
directory whose files are missing or cut short; those are skipped.

A leaf: stdlib only (the agent imports it).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

PLACEHOLDER = re.compile(r"\{resume:([^{}]+)\}")
_NUMBERED = re.compile(r"^(?P<prefix>.*?[A-Za-z])[-_](?P<n>\d+)$")
_RANK_FILE = re.compile(r"^(?:rng_state|random_states)_(\d+)\.(?:pth|pkl)$")
_ZIP_MAGIC = b"PK\x03\x04"
HF_STATE = "trainer_state.json"  # the Trainer writes it last, from rank 0
_DCP_SHARD = ".distcp"  # torch.distributed.checkpoint's per-rank files
_DCP_METADATA = ".metadata"  # ... and its index, written by the coordinator once all are


class ResumeSyntaxError(ValueError):
    """A ``{resume:...}`` placeholder written where trainpod cannot use it."""


@dataclass(frozen=True)
class Expanded:
    """A command with its placeholder filled in (or its argument left out), and what was
    done, in words (the agent writes it at the top of each rank's log)."""

    argv: list[str]
    said: str = ""


def check_command(command: Sequence[str]) -> None:
    """Refuse a placeholder trainpod could not fill in; the message says how to write it.

    At most one argument may hold one, and not as the whole argument: with nothing to resume
    from the argument is left out, and a separate ``--flag`` before it would be left dangling.
    """
    holders = [(i, arg) for i, arg in enumerate(command) if "{resume" in arg]
    if not holders:
        return
    if len(holders) > 1:
        raise ResumeSyntaxError(
            f"the command has {len(holders)} {{resume:DIR}} placeholders "
            f"({', '.join(a for _, a in holders)}); use one"
        )
    i, arg = holders[0]
    found = PLACEHOLDER.findall(arg)
    if len(found) != 1 or arg.count("{resume") != 1:
        raise ResumeSyntaxError(
            f"{arg!r}: write the placeholder as {{resume:DIR}}, DIR the directory the "
            "script writes its numbered checkpoints into, e.g. "
            "--resume_from_checkpoint={resume:out}"
        )
    if PLACEHOLDER.fullmatch(arg):
        flag = command[i - 1] if i > 0 and command[i - 1].startswith("-") else "--flag"
        raise ResumeSyntaxError(
            f"{arg!r} is a whole argument: write it joined to its flag, "
            f"{flag}={arg}, so that trainpod can leave the whole flag out when there is "
            "nothing to resume from yet"
        )


def expand(argv: Sequence[str], *, cwd: str | Path, world_size: int | None) -> Expanded:
    """``argv`` with its ``{resume:DIR}`` filled in from what is on disk now.

    ``cwd``: where a relative ``DIR`` is (the rank's working directory). ``world_size``: the
    ranks of the attempt being started; a checkpoint with per-rank files must have one for
    each (a rank killed before writing its own leaves it without)."""
    for i, arg in enumerate(argv):
        m = PLACEHOLDER.search(arg)
        if m is None:
            continue
        folder = m.group(1)
        found = newest_complete(Path(cwd) / folder, world_size=world_size, shown=folder)
        rest = [*argv[:i], *argv[i + 1 :]]
        if found.path is None:
            return Expanded(rest, f"{{resume:{folder}}}: {found.why}; {arg!r} left out")
        path = os.path.join(folder, found.path.name)
        said = f"{{resume:{folder}}}: resuming from {path}"
        if found.skipped:
            said += f" (skipped {'; '.join(found.skipped)})"
        return Expanded([*argv[:i], arg[: m.start()] + path + arg[m.end() :], *argv[i + 1 :]], said)
    return Expanded(list(argv))


@dataclass(frozen=True)
class Found:
    path: Path | None
    why: str = ""  # why there is none
    skipped: tuple[str, ...] = ()  # newer ones that are not complete, and why


def newest_complete(
    folder: Path, *, world_size: int | None = None, shown: str | None = None
) -> Found:
    """The highest-numbered complete checkpoint in ``folder``, and the newer ones skipped.

    ``shown``: the folder as the messages name it (default: ``folder``)."""
    name = str(folder) if shown is None else shown
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return Found(None, f"no {name} yet")
    except OSError as exc:
        return Found(None, f"cannot list {name}: {exc.strerror or exc}")
    numbered = [(int(m.group("n")), p) for p in entries if (m := _NUMBERED.match(p.name))]
    skipped: list[str] = []
    for _, path in sorted(numbered, key=lambda t: t[0], reverse=True):
        why = incomplete(path, world_size=world_size)
        if why is None:
            return Found(path, skipped=tuple(skipped))
        skipped.append(f"{path.name}: {why}")
    if not numbered:
        return Found(None, f"no numbered checkpoint in {name}")
    return Found(None, f"no complete checkpoint in {name} ({'; '.join(skipped)})")


def incomplete(path: Path, *, world_size: int | None = None) -> str | None:
    """Why the checkpoint at ``path`` is not complete, or None if it is.

    * Every file must be whole: a torch file (a zip: ``torch.save``'s format) must have its
      central directory, which is written last; a ``.safetensors`` file must be as long as
      its header says; a ``.json`` file must parse; no file may be empty.
    * Per-rank files (HF's ``rng_state_<i>.pth``, accelerate's ``random_states_<i>.pkl``):
      one for each of ``world_size`` ranks, if there are any.
    * A ``torch.distributed.checkpoint`` directory (``*.distcp`` shards: Megatron's
      ``torch_dist`` ``iter_N``, torchtitan's ``step-N``) must have its ``.metadata``, which
      DCP writes last, once every rank's shards are written.
    * A Hugging Face ``checkpoint-N`` must have ``trainer_state.json`` (the Trainer writes it
      last) saying ``global_step`` N.
    """
    if not path.is_dir():
        return _file_problem(path)
    try:
        files = sorted(p for p in path.rglob("*") if p.is_file())
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    for f in files:
        why = _file_problem(f)
        if why is not None:
            return f"{f.relative_to(path)} {why}"
    for shards in sorted({f.parent for f in files if f.suffix == _DCP_SHARD}):
        if not (shards / _DCP_METADATA).is_file():
            where = shards.relative_to(path).as_posix()
            return (
                f"{'its' if where == '.' else where + ':'} DCP shards (*{_DCP_SHARD}) have no "
                f"{_DCP_METADATA} (torch.distributed.checkpoint writes it last, after every "
                "rank's shards)"
            )
    ranks = {int(m.group(1)) for f in files if (m := _RANK_FILE.match(f.name))}
    if ranks and world_size is not None:
        missing = sorted(set(range(world_size)) - ranks)
        if missing:
            return f"no per-rank state of rank(s) {', '.join(map(str, missing))}"
    if path.name.startswith("checkpoint-"):
        state = path / HF_STATE
        if not state.is_file():
            return f"no {HF_STATE} (the Trainer writes it last)"
        data = json.loads(state.read_text())
        step = data.get("global_step") if isinstance(data, dict) else None
        if str(step) != path.name.removeprefix("checkpoint-"):
            return f"{HF_STATE} says global_step {step}"
    return None


def _file_problem(f: Path) -> str | None:
    try:
        size = f.stat().st_size
        if size == 0:
            return "is empty"
        with f.open("rb") as fh:
            head = fh.read(8)
            if head[:4] == _ZIP_MAGIC:
                try:
                    with zipfile.ZipFile(fh):
                        return None
                except zipfile.BadZipFile:
                    return "is cut short (a zip without its central directory)"
            if f.suffix == ".safetensors":
                return _safetensors_problem(fh, head, size)
        if f.suffix == ".json":
            try:
                json.loads(f.read_bytes())
            except ValueError:
                return "is not whole JSON"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return None


def _safetensors_problem(fh: BinaryIO, head: bytes, size: int) -> str | None:
    if len(head) < 8:
        return "is cut short (no safetensors header)"
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        return "is cut short (in its safetensors header)"
    try:
        header = json.loads(fh.read(n))
    except ValueError:
        return "is cut short (its safetensors header is not whole JSON)"
    end = max(
        (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
        default=0,
    )
    if 8 + n + end > size:
        return f"is cut short ({size} bytes of {8 + n + end})"
    return None
