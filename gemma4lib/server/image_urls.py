"""Images in chat requests: OpenAI's `image_url` content parts, as data URLs, read into PIL images;
and its `input_audio` parts, base64 WAV or MP3, read and checked.

Only `data:image/...;base64,...` URLs: the endpoint fetches nothing from the network (a server that
fetched client-given URLs could be made to read internal addresses, and it would wait on someone
else's host with a row idle). What comes in is checked here, before a row or the vision graph is
touched, and every refusal is a 400 naming the content part to fix.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from ..errors import AudioInputError
from .errors import RequestError

# The largest decoded image taken (8 MiB): far above what one image's soft-token budget can use, and
# small enough that a request cannot make the host decode something huge.
MAX_IMAGE_BYTES = 8 * 2**20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_AUDIO_BYTES = 2 * 2**20  # 30 s of 16 kHz 16-bit stereo is 1.92 MB


def image_from_data_url(url: str, param: str) -> Any:
    """The RGB PIL image a `data:image/<kind>;base64,<payload>` URL carries."""
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise RequestError(
            "image_url.url must be a data URL (data:image/png;base64,...): this server fetches nothing from "
            "the network; read the file on the client and send its bytes base64-encoded",
            param,
        )
    header, comma, payload = url[len("data:") :].partition(",")
    kind = header.split(";", 1)[0]
    if not comma or not header.endswith(";base64") or not kind.startswith("image/"):
        raise RequestError(
            f"image_url.url must look like data:image/png;base64,<bytes>, got data:{header[:40]},...", param
        )
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise RequestError(f"the image is larger than {MAX_IMAGE_BYTES // 2**20} MiB; send a smaller one", param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("image_url.url's payload is not valid base64", param) from None
    try:
        with Image.open(io.BytesIO(raw)) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise RequestError(
                    f"the image is {opened.width}x{opened.height} pixels, over {MAX_IMAGE_PIXELS:,}; "
                    "send a smaller one",
                    param,
                )
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise RequestError(
            f"image_url.url does not hold an image PIL can read ({error.__class__.__name__}); send a PNG or JPEG", param
        ) from None


def audio_from_input_audio(part: dict[str, Any] | None, param: str) -> Any:
    """The samples of an `{"input_audio": {"data": <base64>, "format": "wav" | "mp3"}}` part, checked as
    `audio.read_wav` checks a file (16 kHz, at most 30 s; read by its bytes), each refusal a 400 saying what to do."""
    from ..models.audio import read_wav

    data, kind = (part or {}).get("data"), (part or {}).get("format")
    if not isinstance(data, str) or kind not in ("wav", "mp3"):
        raise RequestError("an input_audio part is {'data': <base64 of a WAV or MP3>, 'format': 'wav' or 'mp3'}", param)
    if len(data) > (MAX_AUDIO_BYTES * 4) // 3 + 4:
        raise RequestError(f"the audio is larger than {MAX_AUDIO_BYTES // 2**20} MiB; send at most 30 s", param)
    try:
        return read_wav(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError) as error:
        raise RequestError(str(error) if isinstance(error, AudioInputError) else "data is not base64", param) from None
