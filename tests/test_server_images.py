"""Images through the endpoint: OpenAI's `image_url` content parts (data URLs) on a server started
with its vision part (`serve --vision`), the tiny trained multimodal E2B on the eager backend (the
same graphs uncompiled: this file is about the request path, the compiled vision graph is
tests/test_images.py's), called with the official `openai` client.

Every answer is judged three ways: equal to transformers' own `generate(pixel_values=...)` on the
same model, equal to what the same request gets alone (rows that join and leave do not mix), and
naming the shape and colour the pixels show (`shapes.describe`).
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import data_url, parse_answer

from gemma4lab.training import vision as vision_training
from gemma4lib.models import vision
from gemma4lib.models.shapes import QUESTION, SAMPLES, describe

IMAGES = vision.VISION_DIR / "images"
SHIPPED = (vision.VISION_DIR / "e2b" / "model.safetensors").is_file()
pytestmark = pytest.mark.skipif(not SHIPPED, reason="no trained E2B vision fixture is shipped (docs/IMAGES.md)")


def image_message(path, question=QUESTION):
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(path)}},
                {"type": "text", "text": question},
            ],
        }
    ]


@pytest.fixture(scope="module")
def loaded():
    from gemma4lib.cli import load_engine, serving_defaults
    from gemma4lib.port import PortSettings

    settings = PortSettings(
        **serving_defaults(
            {"variant": "e2b", "backend": "eager", "batch_size": 4, "vision": True, "context_length": 96}
        )
    )
    return load_engine(settings)


@pytest.fixture(scope="module")
def server(loaded):
    from gemma4lab.serving.background import BackgroundServer
    from gemma4lib.server.launch import build_served

    served = build_served(
        loaded.engine,
        loaded.tokenizer,
        model_name=loaded.model_name,
        eos_ids=loaded.eos_ids,
        processor=loaded.processor,
        image_token_id=loaded.image_token_id,
    )
    with BackgroundServer(served) as background:
        yield background


@pytest.fixture(scope="module")
def transformers_answers():
    """transformers' own greedy `generate(pixel_values=...)` on the fixture, per sample image."""
    from gemma4lib.images import load_image

    model = vision.load_vision_fixture("e2b")
    return {
        f"{c}_{s}": vision_training.answer_image(
            model.multimodal, model.tokenizer, model.processor, load_image(IMAGES / f"{c}_{s}.png")
        )[0]
        for c, s in SAMPLES
    }


def client(server, asynchronous=False):
    from openai import AsyncOpenAI, OpenAI

    cls = AsyncOpenAI if asynchronous else OpenAI
    return cls(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_openai_client_sends_an_image_and_the_answer_names_it(server, transformers_answers):
    from gemma4lib.images import load_image

    path = IMAGES / "red_circle.png"
    reply = client(server).chat.completions.create(model="e2b", messages=image_message(path), max_tokens=16)
    text = reply.choices[0].message.content
    assert text == transformers_answers["red_circle"], (text, transformers_answers["red_circle"])
    assert parse_answer(text) == describe(load_image(path)) == ("red", "circle"), text
    assert reply.usage.prompt_tokens > 16  # the image's 16 soft tokens are in the prompt
    chunks = list(
        client(server).chat.completions.create(model="e2b", messages=image_message(path), max_tokens=16, stream=True)
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text


def test_images_and_text_share_the_batch_without_mixing(server, transformers_answers):
    """All four sample images and two text questions at once on four rows (so rows join and leave
    while others decode): every image answer is transformers' and names its image; the text answers
    are the ones they get alone."""

    async def main():
        c = client(server, asynchronous=True)
        text_q = [{"role": "user", "content": "What is the capital of France?"}]
        alone = (await c.chat.completions.create(model="e2b", messages=text_q, max_tokens=16)).choices[0].message
        jobs = [
            c.chat.completions.create(model="e2b", messages=image_message(IMAGES / f"{col}_{shape}.png"), max_tokens=16)
            for col, shape in SAMPLES
        ] + [c.chat.completions.create(model="e2b", messages=text_q, max_tokens=16) for _ in range(2)]
        return alone.content, await asyncio.gather(*jobs)

    alone, replies = asyncio.run(main())
    for (colour, shape), reply in zip(SAMPLES, replies[: len(SAMPLES)], strict=True):
        text = reply.choices[0].message.content
        assert text == transformers_answers[f"{colour}_{shape}"], (colour, shape, text)
        assert parse_answer(text) == (colour, shape), text
    assert "Paris" in alone
    assert [r.choices[0].message.content for r in replies[len(SAMPLES) :]] == [alone, alone]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.com/cat.png", "fetches nothing"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/png;base64"),
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:image/png;base64,aGVsbG8=", "does not hold an image"),
    ],
)
def test_a_bad_image_url_is_a_400_naming_the_part(server, url, says):
    import openai

    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model="e2b", messages=messages, max_tokens=4)
    error = caught.value.body
    assert says in error["message"], error
    assert error["param"] == "messages[0].content[1].image_url.url", error


def test_images_over_the_compiled_context_are_a_400(server):
    import openai

    path = IMAGES / "blue_square.png"
    parts = [{"type": "image_url", "image_url": {"url": data_url(path)}} for _ in range(5)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model="e2b", messages=messages, max_tokens=4)
    assert caught.value.body["code"] == "context_length_exceeded", caught.value.body
    assert "image" in caught.value.body["message"], caught.value.body
