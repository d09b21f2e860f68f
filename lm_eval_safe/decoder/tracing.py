"""Where the ensemble acted (``trace=true``): one JSON line per generated response.

SAFE's claim is about *where* it ensembles (rarely, at aligned positions where the members
disagree) and what sharpening does there; totals in ``safe_stats`` cannot show that. A trace
records every ensemble point of a response: its character offset in the response, the drafted
string, the string chosen, each member's and the ensemble's top candidates, whether it was
sharpened, kept or replaced, and for sampled requests speculative sampling's test. Lines are
keyed by ``task``, ``doc_id`` and ``repeat`` so that they join lm-eval's ``samples_*.jsonl``.

Off by default and free when off (the decoder holds ``None`` instead of a
:class:`ResponseTrace`). Each response's line is written when it finishes and flushed to disk
(a crash loses at most the response in flight); nothing is kept in memory afterwards.

Where the lines go: ``trace_dir=`` if given, else lm-eval's output folder, the one its
``--output_path`` and ``--log_samples`` write ``samples_<task>_<date>.jsonl`` to. lm-eval names
that file only when it saves it, at the end, so a trace file is named after its run's start
while the run goes and renamed to ``traces_<task>_<date>.jsonl``, beside its samples file, when
lm-eval writes that (the start-up hook, :mod:`lm_eval_safe._autoregister`, tells this module).
Data-parallel ranks write files of their own (``.rank<r>`` before ``.jsonl``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import weakref
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from lm_eval_safe.ensemble.aggregate import Choice
from lm_eval_safe.errors import OptionError
from lm_eval_safe.members.member import Member
from lm_eval_safe.members.vocabulary import key_text

logger = logging.getLogger("lm_eval_safe")

#: The lm-eval ``EvaluationTracker`` built last in this process (set by the start-up hook).
_tracker: weakref.ReferenceType[Any] | None = None
#: (folder, stamp) of every run that wrote traces in this process, so that the start-up hook
#: can pair their files with lm-eval's samples: lm-eval saves samples after ``simple_evaluate``
#: returned, when the model (and its writer) may be gone. One entry per run: bounded.
_written: list[tuple[Path, str]] = []


class ResponseTrace:
    """The ensemble points of one response, in the order they were decided."""

    def __init__(self, members: list[str]):
        self.members = members  # drafter first, then the verifiers: the order of the views
        self.points: list[dict[str, Any]] = []

    def add_point(
        self,
        drafter: Member,
        generated: list[int],
        tokens: list[int],
        position: int,
        choice: Choice,
        replacement: list[int],
        candidates: tuple[list[Any], list[Any]],
        acceptance: dict[str, float] | None,
    ) -> None:
        """The point at ``tokens[position]`` of a cycle's window, after ``generated``: its
        character offset in the response as the drafter decodes it, what was drafted there,
        chosen, and written (the drafter's ids for the choice), and the candidates
        (:meth:`~lm_eval_safe.ensemble.ensembler.Ensembler.candidates`)."""
        before = drafter.tokenizer.decode(generated + tokens[:position], skip_special_tokens=True)
        members, ensemble = candidates
        point: dict[str, Any] = {
            "index": len(self.points),
            "offset": len(before),
            "position": len(generated) + position,
            "drafted": key_text(drafter.vocab.keys[tokens[position]]),
            "chosen": key_text(choice.key),
            "written": key_text(drafter.vocab.spell(replacement)),
            "action": "replaced" if replacement != tokens[position : position + 1] else "kept",
            "sharpened": choice.sharpened,
            "ensemble": ensemble,
            "members": dict(zip(self.members, members, strict=True)),
        }
        if acceptance is not None:
            point["acceptance"] = acceptance
        self.points.append(point)

    def record(self, text: str, ids: list[int], counts: dict[str, Any], sampled: bool) -> dict[str, Any]:
        return {
            "members": self.members,
            "sampled": sampled,
            "text": text,
            "ids": ids,
            "points": self.points,
            "counts": counts,
        }


def note_tracker(tracker: Any) -> None:
    """Called by the start-up hook for every ``EvaluationTracker`` lm-eval builds."""
    global _tracker
    _tracker = weakref.ref(tracker)


def _tracker_folder(tracker: Any) -> Path:
    """The folder lm-eval writes a run's samples to (its ``save_results_samples`` rule)."""
    path = Path(tracker.output_path)
    if path.suffix == ".json":
        return path.parent
    return path / str(tracker.general_config_tracker.model_name_sanitized)


def new_stamp() -> str:
    """A run's start as part of a file name (lm-eval's date_id format)."""
    return datetime.now().isoformat().replace(":", "-")


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


class TraceWriter:
    """Appends trace lines to one file per task, flushed and synced per response."""

    def __init__(self, trace_dir: str | None, stamp: str, rank: int, world_size: int):
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.tracker = _tracker() if (trace_dir is None and _tracker is not None) else None
        if self.trace_dir is None and (self.tracker is None or not self.tracker.output_path):
            raise OptionError(
                "trace=true needs somewhere to write: run lm_eval with --output_path (and "
                "--log_samples, to join traces with samples) or give trace_dir=FOLDER"
            )
        self.stamp = stamp  # the run's start, the same on every rank (see new_stamp)
        self.suffix = f".rank{rank}.jsonl" if world_size > 1 else ".jsonl"
        self.files: dict[str, IO[str]] = {}
        self.responses = 0

    @property
    def folder(self) -> Path:
        """Resolved at the first write: lm-eval names its output folder after building the model."""
        if self.trace_dir is not None:
            return self.trace_dir
        return _tracker_folder(self.tracker)

    def write(self, task: str | None, record: dict[str, Any]) -> None:
        name = _safe_name(task or "requests")
        handle = self.files.get(name)
        if handle is None:
            folder = self.folder
            folder.mkdir(parents=True, exist_ok=True)
            if (folder, self.stamp) not in _written:
                _written.append((folder, self.stamp))
            path = folder / f"traces_{name}_{self.stamp}{self.suffix}"
            handle = self.files[name] = path.open("a", encoding="utf-8")
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
        self.responses += 1

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()
        self.files.clear()


def samples_saved(tracker: Any, task_name: str) -> None:
    """Called by the start-up hook after lm-eval wrote a task's samples file: this run's trace
    files of the task are renamed to sit beside it (an open handle follows its file)."""
    if not tracker.output_path:
        return
    if "date_id" not in vars(tracker):  # lm-eval could not save the results (it logged why)
        logger.warning("trace files keep their start-time names: lm-eval saved no results to pair with")
        return
    folder = _tracker_folder(tracker).resolve()
    name = _safe_name(task_name)
    for written, stamp in _written:
        if written.resolve() != folder:
            continue
        prefix = f"traces_{name}_{stamp}"
        for path in sorted(folder.glob(prefix + "*.jsonl")):  # every rank's: they share the stamp
            path.rename(folder / (f"traces_{name}_{tracker.date_id}" + path.name[len(prefix) :]))


def repeat_indices(requests: list[Any]) -> list[int]:
    """Each request's repeat index: lm-eval sends a task with ``repeats: k`` as the same
    request object k times, and the samples file keeps their responses in that order."""
    seen: dict[int, int] = {}
    indices = []
    for request in requests:
        seen[id(request)] = seen.get(id(request), -1) + 1
        indices.append(seen[id(request)])
    return indices
