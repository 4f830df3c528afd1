"""Speak the few clips the audio tests and notebooks need with espeak-ng, and write them as Gemma-4
hears: 16 kHz, mono, 16-bit PCM WAV, under gemma4lib/fixtures/audio/ with PROVENANCE.json.

espeak-ng writes 22,050 Hz; the clips are resampled here once (scipy's polyphase `resample_poly`,
320/441), so neither CI nor the library needs espeak-ng or a resampler. Run once, commit the output:

    apt-get install -y espeak-ng
    .venv/bin/python scripts/make_audio_clips.py
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gemma4lab.training import hearing  # noqa: E402

OUT = ROOT / "gemma4lib" / "fixtures" / "audio"
VOICE, SPEED = "en-us", 150  # espeak-ng -v, -s (words per minute)
RATE = 16_000
CLIPS = {
    "france.wav": "France",
    "japan.wav": "Japan",
    "italy.wav": "Italy",
    "capital_of_france.wav": "What is the capital of France?",
}


def speak(text: str) -> tuple[np.ndarray, list[str]]:
    """espeak-ng's float samples of `text` at 16 kHz in the clips' voice, and the command that spoke them."""
    return hearing.speak(text, VOICE, SPEED)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    version = subprocess.run(["espeak-ng", "--version"], check=True, capture_output=True, text=True).stdout
    version = version.split("  Data at")[0].strip()  # not the data path of this machine
    files = {}
    for name, text in CLIPS.items():
        samples, command = speak(text)
        pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
        with wave.open(str(OUT / name), "wb") as clip:
            clip.setnchannels(1)
            clip.setsampwidth(2)
            clip.setframerate(RATE)
            clip.writeframes(pcm.tobytes())
        files[name] = {
            "text": text,
            "command": " ".join(command[:-1]) + f" {json.dumps(text)}",
            "samples": len(pcm),
            "seconds": round(len(pcm) / RATE, 3),
            "sha256": hashlib.sha256((OUT / name).read_bytes()).hexdigest(),
        }
    provenance = {
        "script": "scripts/make_audio_clips.py",
        "espeak_ng": version,
        "voice": VOICE,
        "words_per_minute": SPEED,
        "format": "WAV, 16 kHz, mono, 16-bit PCM (espeak-ng's 22,050 Hz resampled by scipy.signal.resample_poly)",
        "files": files,
    }
    (OUT / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1) + "\n")


if __name__ == "__main__":
    main()
