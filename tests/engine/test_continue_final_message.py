"""`continue_final_message` / `add_generation_prompt` on /v1/chat/completions (vLLM's semantics): the last
message is left open and the model continues it; a gateway resuming a stream elsewhere relies on it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from conftest import StartServer

from engine.models.loader import LoadedModel

MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.mark.timeout(120)
def test_rendering_matches_transformers(smollm2_model: LoadedModel, smollm2_hf_tokenizer: Any) -> None:
    reference = smollm2_hf_tokenizer
    ours = smollm2_model.tokenizer
    for partial in ("Red, ", "Red, green", " spaced  "):
        messages = [*MESSAGES, {"role": "assistant", "content": partial}]
        assert ours.apply_chat_template(
            messages, add_generation_prompt=False, continue_final_message=True
        ) == reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False) == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False
    )


async def test_both_switches_are_refused(start_server: StartServer, http: aiohttp.ClientSession) -> None:
    server = await start_server()
    body = {
        "messages": [*MESSAGES, {"role": "assistant", "content": "Red"}],
        "max_tokens": 2,
        "continue_final_message": True,
        "add_generation_prompt": True,
    }
    async with http.post(server.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 400
        assert "Cannot set both" in (await r.json())["error"]["message"]
    body.pop("add_generation_prompt")  # vLLM: continuing implies no generation prompt
    async with http.post(server.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()


@pytest.mark.timeout(180)
async def test_continuing_a_greedy_answer_gives_the_rest_of_it(
    start_server: StartServer, smollm2_model: LoadedModel, http: aiohttp.ClientSession
) -> None:
    server = await start_server(smollm2_model, model="smollm2", num_kvcache_blocks=64, max_model_len=512)
    url = server.url + "/v1/chat/completions"
    greedy = {"model": "smollm2", "temperature": 0, "ignore_eos": True}
    async with http.post(url, json={**greedy, "messages": MESSAGES, "max_tokens": 10}) as r:
        whole = await r.json()
    text = whole["choices"][0]["message"]["content"]
    async with http.post(url, json={**greedy, "messages": MESSAGES, "max_tokens": 4}) as r:
        head = (await r.json())["choices"][0]["message"]["content"]
    assert text.startswith(head)
    body = {
        **greedy,
        "messages": [*MESSAGES, {"role": "assistant", "content": head}],
        "max_tokens": 6,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    async with http.post(url, json=body) as r:
        rest = await r.json()
    assert head + rest["choices"][0]["message"]["content"] == text
    assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 4
