"""What a notebook section "What the model hears" calls: the clip as a waveform, what the host makes of
it for the audio graph (the log-mel spectrogram, or the 12B's raw 640-sample frames) and how many soft
tokens that becomes. Every plot returns a matplotlib `Figure` (no pyplot, as `plots.py`).

The data comes from the port's own host functions (`gemma4lib.models.audio`), so the pictures show what
the audio graph is given, not a drawing of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

SAMPLE_RATE = 16_000


def sound_picture(samples: np.ndarray, unified: bool = False, title: str | None = None) -> Figure:
    """The clip (top) and the audio graph's input (bottom): E2B/E4B the log-mel spectrogram (128 bins, a
    frame every 10 ms; every 4th valid frame becomes one soft token after the encoder's two stride-2
    convolutions), the 12B its raw 40 ms frames (one soft token each), drawn on the waveform."""
    from gemma4lib.models import audio

    values, valid = audio.features(samples, unified)
    count = audio.soft_tokens(samples, unified)
    seconds = np.arange(len(samples)) / SAMPLE_RATE
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    top.plot(seconds, samples, linewidth=0.5)
    top.set_xlim(0, seconds[-1])
    top.set_ylabel("amplitude")
    top.set_title(title or f"{len(samples) / SAMPLE_RATE:.2f} s at 16 kHz -> {count} soft tokens", fontsize=9)
    if unified:
        bottom.plot(seconds, samples, linewidth=0.5, color="grey")
        for edge in range(0, len(samples) + 1, audio.UNIFIED_SAMPLES):
            bottom.axvline(edge / SAMPLE_RATE, color="tab:orange", linewidth=0.4)
        bottom.set_xlim(0, seconds[-1])
        bottom.set_title(
            f"{len(values)} frames of {audio.UNIFIED_SAMPLES} samples (40 ms): one soft token each", fontsize=9
        )
    else:
        bottom.imshow(values[valid].T, origin="lower", aspect="auto", extent=(0, valid.sum() / 100, 0, values.shape[1]))
        bottom.set_ylabel("mel bin")
        bottom.set_title(
            f"log-mel: {int(valid.sum())} frames x {values.shape[1]} bins, every 4th -> a soft token", fontsize=9
        )
    bottom.set_xlabel("seconds")
    return fig


def clip_table(clips: dict[str, np.ndarray], unified: bool = False) -> list[dict[str, Any]]:
    """Per clip: its length, the audio graph's input frames and its soft tokens (the placeholders in the prompt)."""
    from gemma4lib.models import audio

    rows = []
    for name, samples in clips.items():
        values, valid = audio.features(samples, unified)
        rows.append(
            {
                "clip": name,
                "seconds": round(len(samples) / SAMPLE_RATE, 3),
                "frames": int(valid.sum()),
                "soft tokens": audio.soft_tokens(samples, unified),
            }
        )
    return rows


def audio_demo(clip: Any, inputs: Any, reports: dict[str, Any], compiled: Any) -> dict[str, Any]:
    """What the run record keeps of the notebook's audio section: the clip, its soft tokens and where they
    sat, and per task (transcription, the spoken question) the answer and the three checks."""
    from gemma4lab.notebook.records import report_checks
    from gemma4lib.models.audio import CLIPS_DIR

    shipped = Path(clip).resolve().parent == CLIPS_DIR
    return {
        "clip": Path(clip).name if shipped else str(clip),  # a shipped clip by name: no machine path
        "soft_tokens": list(inputs.prompt.audio_counts),
        "positions": [inputs.prompt.audio_positions[0], inputs.prompt.audio_positions[-1]],
        "prompt_tokens": len(inputs.ids),
        "audio_input": list(inputs.prompt.audio[0][0].shape),
        "tasks": {task: report_checks(report) for task, report in reports.items()},
        "compile_s": compiled.compile_s,
        "cache_hits": list(compiled.cache_hits),
    }
