"""`specjax serve` with the real `openai` client against a server on 127.0.0.1 (the embedded pair).

One server per module (its programs compile once); each test talks HTTP to it.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import specjax  # noqa: E402
from specjax._src.serve import scheduler as sched  # noqa: E402
from specjax._src.serve.api import ServerConfig, create_app  # noqa: E402
from specjax._src.serve.server import make_server  # noqa: E402
from specjax.engine import Engine, SlotSettings  # noqa: E402
from specjax.rules import ears, mars, one_of, speculative_sampling, typical  # noqa: E402
from test_decode import count_compilations  # noqa: E402

K, CAPACITY, SLOTS, MAX_QUEUE, LOGPROBS = 4, 128, 2, 2, 5
MAX_BODY = 64 * 1024
MODEL = "embedded"
# The embedded pair has no chat template of its own; the server takes one (--chat-template).
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant:{% endif %}")
PROMPT = "def fib(n):"
# The rules a request may choose (`specjax serve --rules sd,mars:theta=0.5,ears:beta=0.5,typical`);
# the first, lossless, is what every request that names none gets.
RULES = (speculative_sampling(), mars(theta=0.5), ears(beta=0.5), typical())
# How long a test waits for something the server does "at once" or "within a step": waits poll
# and return as soon as it happens, so the bound costs nothing on a quiet machine, and it is
# generous because a busy one (a 2-core machine at load 7-9 ran out of a 5 s bound) may take
# seconds per step. Whether it happened at once is shown by counters and events, not a tight clock.
WAIT = 60.0


class Server:
    """The server `specjax serve` runs (its draining shutdown included), in a thread, on a socket
    bound to a free port of 127.0.0.1."""

    def __init__(self, app, drain_seconds: float = 5.0):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, app.state.scheduler, drain_seconds=drain_seconds, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@pytest.fixture(scope="module")
def setup():
    target = specjax.load("embedded-target", dtype="float32").replace(chat_template=TEMPLATE)
    draft = specjax.load("embedded-draft", dtype="float32")
    pair = specjax.pair(target, draft)
    # As `specjax serve` builds it: one prompt width, each step and insert reuses the state's buffers,
    # and each step runs the program for its requests' settings; a request may pick one of RULES.
    engine = Engine(pair, num_slots=SLOTS, capacity=CAPACITY, num_draft=K, prompt_bucket=CAPACITY, donate_state=True,
                    specialized_steps=True, max_bias=300, logprobs=LOGPROBS, rule=one_of(*RULES))
    scheduler = sched.Scheduler(engine, target.tokenizer, max_queue=MAX_QUEUE, num_cycles=2,
                                eos_ids=[target.module.config.eos_token_id])
    config = ServerConfig(MODEL, target, max_body_bytes=MAX_BODY)
    server = Server(create_app(scheduler, config, drain_seconds=5))
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code in (200, 503)
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield dict(url=server.url, client=client, scheduler=scheduler, target=target, pair=pair, engine=engine,
                   config=config)
    finally:
        server.stop()
    assert not scheduler._thread.is_alive(), "the scheduler's loop outlived the server"


def metrics(url) -> dict:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def test_greedy_completion_equals_decode(setup):
    client, target = setup["client"], setup["target"]
    with count_compilations() as compiled:  # the warm-up compiled every step program
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        for top_p in (1.0, 0.9):  # the sampled program, then the general one
            sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                                top_p=top_p, seed=1)
            assert sampled.usage.completion_tokens > 0
    assert compiled["n"] == 0
    ids = target.tokenizer.encode(PROMPT).ids
    ref = specjax.decode(setup["pair"], [ids], num_draft=K, max_new_tokens=24, temperature=0.0,
                         max_length=CAPACITY + K).to_lists()[0]
    assert r.choices[0].text == target.tokenizer.decode(ref)
    assert r.usage.completion_tokens == len(ref) and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason == ("length" if len(ref) == 24 else "stop")
    spec = r.model_extra["speculative"]
    assert spec["cycles"] >= 1 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["tau"] == pytest.approx((len(ref) - 1) / spec["cycles"])  # the first token is the prefill's
    # Speculative decoding off for this request (num_draft 0): the same greedy text, no drafts.
    off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"num_draft": 0})
    assert off.choices[0].text == r.choices[0].text
    assert off.model_extra["speculative"]["drafted"] == 0


def test_a_rule_per_request(setup):
    """`"speculative": {"rule": ...}` picks one of the served rules for this request: a greedy request
    gets what decode gives it alone with that rule, the response names it, and no program compiles."""
    client, target, pair = setup["client"], setup["target"], setup["pair"]
    ids = target.tokenizer.encode(PROMPT).ids
    with count_compilations() as compiled:
        got = {spec: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                               extra_body={"speculative": {"rule": spec}} if spec else None)
               for spec in (None, "mars:theta=0.5", "mars:theta=0.2", "typical", "sd")}
        sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=4,
                                            extra_body={"speculative": {"rule": "ears:beta=0.5"}})
        off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"speculative": {"rule": "mars:theta=0.2", "num_draft": 0}})
    assert compiled["n"] == 0
    for spec, rule in ((None, RULES[0]), ("mars:theta=0.5", RULES[1]), ("mars:theta=0.2", mars(theta=0.2)),
                       ("typical", RULES[3]), ("sd", RULES[0])):
        ref = specjax.decode(pair, [ids], rule=rule, num_draft=K, max_new_tokens=24, temperature=0.0,
                             max_length=CAPACITY + K).to_lists()[0]
        assert got[spec].choices[0].text == target.tokenizer.decode(ref), spec
        assert got[spec].model_extra["speculative"]["rule"] == str(rule), spec
    assert got["mars:theta=0.2"].choices[0].text != got[None].choices[0].text  # MARS relaxed a token
    # No drafts (speculative.num_draft 0), nothing to relax: the target's own greedy text.
    assert off.model_extra["speculative"]["drafted"] == 0 and off.choices[0].text == got[None].choices[0].text
    ref = specjax.decode(pair, [ids], rule=ears(beta=0.5), num_draft=K, max_new_tokens=12, temperature=1.0,
                         key=jax.random.key(4), max_length=CAPACITY + K).to_lists()[0]
    assert sampled.choices[0].text == target.tokenizer.decode(ref)
    assert sampled.model_extra["speculative"]["rule"] == "ears:beta=0.5"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True,
                                                 extra_body={"speculative": {"rule": "mars:theta=0.5"}}))
    assert [ch.model_extra["speculative"]["rule"] for ch in chunks if "speculative" in ch.model_extra] == \
        ["mars:theta=0.5"]
    # A rule outside the set: 400, naming the rules served.
    with pytest.raises(openai.BadRequestError, match="ears:beta=0.5, typical:eps=0.09") as refused:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"speculative": {"rule": "block_verification"}})
    assert refused.value.body["param"] == "speculative.rule"
    card = httpx.get(setup["url"] + "/v1/models", timeout=5).json()["data"][0]["speculative"]
    assert card == {"rules": [str(r) for r in RULES], "default_rule": "speculative_sampling", "num_draft": K,
                    "tree": None}


def test_cli_rule_sets():
    """`--rules A,B,...` serves one_of(A, B, ...); a set cannot hold PAD (its head is an array)."""
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    def rule(*argv):
        return serve.served_rule(build_parser().parse_args(["serve", *argv]))

    assert rule() == speculative_sampling() and rule("--rule", "mars:theta=0.9") == mars(0.9)
    assert rule("--rules", "sd,mars:theta=0.5,ears:beta=0.5,typical") == one_of(*RULES)
    assert rule("--rules", "typical") == typical()
    with pytest.raises(SystemExit, match="not both"):
        rule("--rule", "sd", "--rules", "sd,mars")
    with pytest.raises(SystemExit, match="--rules 'sd,marz'"):
        rule("--rules", "sd,marz")
    with pytest.raises(SystemExit, match="holds arrays"):
        rule("--rules", "sd,pad:head=specjax/assets/pivot")


def test_streaming_and_seed(setup):
    client = setup["client"]
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, **args).choices[0].text
    b = client.completions.create(seed=7, **args).choices[0].text
    c = client.completions.create(seed=8, **args).choices[0].text
    assert a == b and a != c
    chunks = list(client.completions.create(seed=7, stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == a
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) >= 2  # streamed, not one block
    assert chunks[-2].choices[0].finish_reason in ("stop", "length") and "speculative" in chunks[-2].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_uses_the_template(setup):
    client, target = setup["client"], setup["target"]
    messages = [{"role": "system", "content": "code"}, {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    ids = specjax.encode_chat(target, messages)
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_string_cuts_the_text(setup):
    client = setup["client"]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[10:14]
    assert stop.strip(), f"pick another slice of {full!r}"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text


BAD = [
    # (route, body changes, param, code)
    ("completions", {"model": "gpt-4"}, "model", "model_not_found"),
    ("completions", {"temperature": "hot"}, "temperature", "invalid_value"),
    ("completions", {"max_tokens": 1.5}, "max_tokens", "invalid_value"),
    ("completions", {"max_tokens": CAPACITY}, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": [5] * CAPACITY}, "prompt", "context_length_exceeded"),
    ("completions", {"prompt": "x = 1\n" * 4000}, "prompt", "context_length_exceeded"),
    ("completions", {"n": 0}, "n", "invalid_value"),
    ("completions", {"n": SLOTS + 1}, "n", "invalid_value"),
    ("completions", {"logprobs": LOGPROBS + 1}, "logprobs", "invalid_value"),
    ("completions", {"prompt": ["a", 5]}, "prompt", "invalid_value"),
    ("completions", {"prompt": [[5, 6], [10**7]]}, "prompt", "invalid_value"),
    ("completions", {"max_tokens": -1}, "max_tokens", "invalid_value"),
    ("completions", {"stop": ["a"] * 1025}, "stop", "invalid_value"),
    ("completions", {"temperature": 3}, "temperature", "invalid_value"),
    ("completions", {"top_k": 10**6}, "top_k", "invalid_value"),
    ("completions", {"presence_penalty": 5}, "presence_penalty", "invalid_value"),
    ("completions", {"stop": [""]}, "stop", "invalid_value"),
    ("completions", {"stop": ["x" * 300]}, "stop", "invalid_value"),
    ("completions", {"seed": -1}, "seed", "invalid_value"),
    ("completions", {"num_draft": K + 1}, "num_draft", "invalid_value"),
    ("completions", {"speculative": {"num_draft": K + 1}}, "speculative.num_draft", "invalid_value"),
    ("completions", {"speculative": {"num_draft": 1}, "num_draft": 2}, "speculative.num_draft", "invalid_value"),
    ("completions", {"speculative": {"rule": "top_m:m=2"}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": "mars:theta=0.5,variant=authors"}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": "marz"}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": "mars:theta=-1"}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": "pad:head=/etc"}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": "any_of(" * 5000}}, "speculative.rule", "invalid_value"),
    ("completions", {"speculative": {"rule": 3}}, "speculative.rule", "invalid_value"),
    ("chat", {"speculative": {"rules": "sd"}}, "speculative.rules", "invalid_value"),
    ("completions", {"min_tokens": 9}, "min_tokens", "invalid_value"),
    ("completions", {"stop_token_ids": [10**7]}, "stop_token_ids", "invalid_value"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ("completions", {"prompt": "\ud800"}, "prompt", "invalid_value"),
    ("completions", {"model": "\udfff"}, "model", "invalid_value"),
    ("completions", {"suffix": "}"}, "suffix", "unsupported"),
    ("completions", {"best_of": 2}, "best_of", "unsupported"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json", "unsupported"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("chat", {"logprobs": True, "top_logprobs": LOGPROBS + 1}, "top_logprobs", "invalid_value"),
    ("chat", {"messages": []}, "messages", "invalid_value"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "invalid_value"),
    ("chat", {"messages": [{"role": "user"}], "max_tokens": "10"}, "max_tokens", "invalid_value"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format", "unsupported"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "unsupported"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "unsupported"),
    ("completions", {"repetition_penalty": 1e-300}, "repetition_penalty", "invalid_value"),
    ("completions", {"repetition_penalty": 1e-38, "temperature": 1.0}, "repetition_penalty", "invalid_value"),
    ("completions", {"logit_bias": {" 5": 1}}, "logit_bias", "invalid_value"),
    ("completions", {"logit_bias": {"05": 1}}, "logit_bias", "invalid_value"),
    ("completions", {"logit_bias": {"\u0665": 1}}, "logit_bias", "invalid_value"),
    ("completions", {"min_tokens": -1}, "min_tokens", "invalid_value"),
    ("completions", {"prompt": [True]}, "prompt", "invalid_value"),
    ("completions", {"stop_token_ids": list(range(17))}, "stop_token_ids", "invalid_value"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ("chat", {"messages": [{"role": "user", "content": ""}] * (CAPACITY + 1)}, "messages",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("route,change,param,code", BAD, ids=[f"{r}-{'-'.join(c)}" for r, c, _, _ in BAD])
def test_bad_request_gets_an_openai_error_body(setup, route, change, param, code):
    body = ({"model": MODEL, "prompt": PROMPT, "max_tokens": 8} if route == "completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    # Sent as written (json= would refuse the lone surrogates): the escapes reach the server as JSON has them.
    content = json.dumps({**body, **change}).encode()
    r = httpx.post(setup["url"] + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code
    assert len(error["message"]) > 10
    # The request's own field names, not the engine's.
    assert not any(name in error["message"] for name in ("controls.", "max_new_tokens", "min_new_tokens"))


def test_bad_requests_through_the_client(setup):
    client = setup["client"]
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="slot capacity"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**4)
    r = httpx.post(setup["url"] + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_frees_its_slot(setup):
    url, scheduler = setup["url"], setup["scheduler"]
    before = scheduler.metrics()["requests_cancelled"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "min_tokens": 100, "temperature": 0.8,
            "seed": 1, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"]
    deadline = time.monotonic() + WAIT  # left as soon as the slot is free
    while time.monotonic() < deadline:
        m = scheduler.metrics()
        if m["requests_cancelled"] > before and m["live_slots"] == 0:
            break
        time.sleep(0.05)
    m = metrics(url)
    assert m["specjax_requests_cancelled_total"] == before + 1 and m["specjax_live_slots"] == 0


def test_full_queue_is_refused_not_hung(setup):
    client, scheduler, url = setup["client"], setup["scheduler"], setup["url"]
    results = []

    def ask(seed):
        results.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, seed=seed))

    # The free slots take requests beyond the queue: SLOTS + MAX_QUEUE may wait while admission is held.
    with scheduler.paused():
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(SLOTS + MAX_QUEUE)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT
        while scheduler.metrics()["queue_depth"] < SLOTS + MAX_QUEUE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metrics(url)["specjax_queue_depth"] == SLOTS + MAX_QUEUE
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        # Refused, not queued: a queued request would wait (admission is held) until the client's
        # 60 s timeout. The bound sits well under that, and well over a busy machine's round trip.
        assert time.monotonic() - t0 < 30
        assert refused.value.status_code == 429 and refused.value.body["code"] == "queue_full"
        assert refused.value.response.headers["retry-after"] == "1"
    for t in threads:
        t.join(timeout=30)
    assert len(results) == SLOTS + MAX_QUEUE and all(r.usage.completion_tokens > 0 for r in results)  # none lost
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_models_health_and_metrics(setup):
    url = setup["url"]
    setup["client"].completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)  # one at least
    assert [m.id for m in setup["client"].models.list()] == [MODEL]
    assert httpx.get(url + f"/v1/models/{MODEL}", timeout=5).json()["speculative"]["rules"][0] == \
        "speculative_sampling"
    assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
    m = metrics(url)
    assert m["specjax_requests_finished_total"] >= 1 and m["specjax_slots"] == SLOTS
    assert 0 <= m["specjax_acceptance_rate"] <= 1 and m["specjax_tau"] >= 1
    assert 0 <= m["specjax_host_share"] < 1 and m["specjax_step_seconds_total"] > 0
    assert 1 <= m["specjax_prefills_total"] <= m["specjax_prefilled_requests_total"]


def test_close_refuses_waiting_requests(setup):
    """Shutdown: a request still waiting for a slot is refused with a reason; later ones are refused at once."""
    engine, target = setup["engine"], setup["target"]
    scheduler = sched.Scheduler(engine, target.tokenizer, max_queue=4, num_cycles=2, warmup_widths=(16,)).start()
    assert scheduler.ready.wait(120)
    events = []
    with scheduler.paused():
        request = sched.Request(prompt=[5, 6, 7], settings=SlotSettings(temperature=0.0, max_new_tokens=4),
                                emit=events.append)
        scheduler.submit(request)
        scheduler.close(drain_seconds=5)
    assert events == [sched.Failed(events[0].message, "shutting_down")] and "shutting down" in events[0].message
    with pytest.raises(sched.Closed):
        scheduler.submit(request)
    assert not scheduler._thread.is_alive()


def test_shutdown_finishes_a_live_stream(setup):
    """What SIGINT / SIGTERM do (uvicorn sets ``should_exit``): a live stream runs to its end, then the loop stops."""
    engine, target = setup["engine"], setup["target"]
    scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=2, warmup_widths=(16,),
                                eos_ids=[target.module.config.eos_token_id])
    server = Server(create_app(scheduler, ServerConfig(MODEL, target), drain_seconds=20))
    server.wait_ready(120)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "min_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.server.should_exit = True
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    server.thread.join(timeout=30)
    assert not server.thread.is_alive() and not scheduler._thread.is_alive()
    server.sock.close()


def test_a_lone_request_runs_the_cycles_that_fit_the_admission_wait(setup, monkeypatch):
    """While a slot is free and nobody waits, a step runs as many cycles as fit in
    ``admission_wait`` at the cycles' timed seconds: one before any step is timed and while
    the request has no tokens yet, then up to ``num_cycles``; a long wait gives every later
    step all of them, none gives one each. The text is ``decode``'s either way."""
    engine, target, pair = setup["engine"], setup["target"], setup["pair"]
    prompt = target.tokenizer.encode("def fib(n):").ids
    ref = specjax.decode(pair, [prompt], num_draft=K, max_new_tokens=40, temperature=0.0, eos_token_id=(),
                         max_length=CAPACITY + K).to_lists()[0]
    step = engine.step
    for wait, later_steps in ((60.0, {8}), (0.0, {1})):
        calls = []

        def recording_step(state, num_cycles=1, **kwargs):
            calls.append(num_cycles)
            return step(state, num_cycles, **kwargs)

        monkeypatch.setattr(engine, "step", recording_step)
        scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=8, warmup_widths=(16,), admission_wait=wait)
        scheduler.start()
        assert scheduler.ready.wait(120)
        calls.clear()
        got = []
        scheduler.submit(sched.Request(prompt=prompt, emit=got.append,
                                       settings=SlotSettings(temperature=0.0, max_new_tokens=40, eos_token_id=())))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (got and isinstance(got[-1], sched.Done)):
            time.sleep(0.02)
        scheduler.close(drain_seconds=5)
        assert calls[0] == 1 and set(calls[1:]) == later_steps, (wait, calls)
        assert "".join(e.text for e in got if isinstance(e, sched.Delta)) == target.tokenizer.decode(ref)
    with pytest.raises(ValueError, match="admission_wait"):
        sched.Scheduler(engine, target.tokenizer, admission_wait=-0.1)


def test_the_admission_wait_sizes_steps_from_their_timed_cycles():
    """The arithmetic behind it: the median of each row bucket's last steps' seconds per
    cycle, and the nearest whole number of them in the wait; a forked slot's copied counts (more cycles than the step asked) are not a timing; a full
    server or a waiting request gets every cycle; a wait that is not seconds is refused, by
    the scheduler's own check and by `specjax serve`'s before anything loads."""
    from specjax._src.serve.step_length import StepLength
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    steps = StepLength(num_cycles=8, admission_wait=0.1)
    rows = 1
    assert steps.cycles(rows, free=True, waiting=False) == 1  # nothing timed yet
    steps.observe(rows, 2, np.array([2, 0]), 0.06)  # 30 ms a cycle
    assert steps.cycles(rows, free=True, waiting=False) == 3
    assert steps.cycles(rows, free=False, waiting=False) == 8
    assert steps.cycles(rows, free=True, waiting=True) == 8
    assert steps.cycles(rows, free=True, waiting=False, fresh=True) == 1  # a request's first tokens
    steps.observe(rows, 2, np.array([9]), 0.001)  # copied counts: not a timing
    assert steps.cycles(rows, free=True, waiting=False) == 3
    steps.observe(rows, 4, np.array([4, 4]), 0.008)  # 2 ms a cycle: the median of two is 16 ms
    assert steps.cycles(rows, free=True, waiting=False) == 6
    steps.observe(rows, 4, np.array([4]), 0.0)
    assert steps.cycles(rows, free=True, waiting=False) == 8  # never more than num_cycles
    # The median of the last steps: a step forced to a dear length (or a one-cycle step) among
    # 30 ms ones does not shorten the next steps, as a mean would (75 ms: one cycle).
    robust = StepLength(num_cycles=8, admission_wait=0.1)
    for seconds in (0.03, 0.03, 0.12):
        robust.observe(rows, 1, np.array([1]), seconds)
    assert robust.cycle_seconds(rows) == pytest.approx(0.03)
    assert robust.cycles(rows, free=True, waiting=False) == 3
    for _ in range(robust.window):  # the window moves on: a lasting change is followed
        robust.observe(rows, 1, np.array([1]), 0.06)
    assert robust.cycles(rows, free=True, waiting=False) == 2
    assert steps.cycles(2, free=True, waiting=False) == 1  # another row bucket: timed apart
    # The nearest whole number of cycles, not the floor: cycles of 34 and 32 ms both run 3 a step.
    for per_cycle in (0.034, 0.032):
        nearest = StepLength(num_cycles=8, admission_wait=0.1)
        nearest.observe(rows, 2, np.array([2]), 2 * per_cycle)
        assert nearest.cycles(rows, free=True, waiting=False) == 3
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="admission_wait"):
            StepLength(8, bad)
    with pytest.raises(SystemExit, match="--admission-wait-ms must be milliseconds >= 0"):
        serve.check_args(build_parser().parse_args(["serve", "--admission-wait-ms", "-5"]))


def test_a_waiting_request_takes_a_slot_as_soon_as_one_frees(setup, monkeypatch):
    """Steps stop at the first request that finishes (``until_first_finish``) instead of running
    all their cycles; with ``admission_wait=0``, while a slot is free and nobody waits they run
    one cycle, so an arrival waits at most one; requests admitted together are prefilled
    together; every request still gets the text ``decode`` gives it alone."""
    engine, target, pair = setup["engine"], setup["target"], setup["pair"]
    calls, inserts, step, insert_many = [], [], engine.step, engine.insert_many
    scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=16, warmup_widths=(16,), admission_wait=0.0)

    def recording_step(state, num_cycles=1, *, until_first_finish=False, plan=None, costs=None):
        free = engine.num_slots - len(scheduler._live)
        calls.append((num_cycles, until_first_finish, bool(free and scheduler._waiting)))
        return step(state, num_cycles, until_first_finish=until_first_finish, plan=plan, costs=costs)

    def recording_insert_many(state, slots, prompts, settings=None):
        inserts.append([len(p) for p in prompts])
        return insert_many(state, slots, prompts, settings)

    monkeypatch.setattr(engine, "step", recording_step)
    monkeypatch.setattr(engine, "insert_many", recording_insert_many)
    scheduler.start()
    assert scheduler.ready.wait(120)
    calls.clear()
    inserts.clear()
    prompts = [target.tokenizer.encode(p).ids for p in ("def fib(n):", "class Stack:", "x = [1, 2, 3]\nfor")]
    lengths, events = (3, 40, 6), [[] for _ in prompts]
    with scheduler.paused():
        for prompt, n, got in zip(prompts, lengths, events):
            settings = SlotSettings(temperature=0.0, max_new_tokens=n, eos_token_id=())
            scheduler.submit(sched.Request(prompt=prompt, settings=settings, emit=got.append))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(got and isinstance(got[-1], sched.Done) for got in events):
        time.sleep(0.02)
    scheduler.close(drain_seconds=5)
    assert calls and all(until_first_finish for _, until_first_finish, _ in calls)
    assert calls[0][0] == 16  # both slots busy, the third request waiting
    assert 1 in [n for n, _, _ in calls]  # the long request alone: one cycle per step
    assert not any(free_and_waiting for _, _, free_and_waiting in calls)  # admitted before each step
    assert inserts == [sorted(map(len, prompts[:2])), [len(prompts[2])]]  # the first two in one prefill
    assert (scheduler.counters.prefills, scheduler.counters.prefilled_requests) == (2, 3)
    for prompt, n, got in zip(prompts, lengths, events):
        ref = specjax.decode(pair, [prompt], num_draft=K, max_new_tokens=n, temperature=0.0, eos_token_id=(),
                             max_length=CAPACITY + K).to_lists()[0]
        assert "".join(e.text for e in got if isinstance(e, sched.Delta)) == target.tokenizer.decode(ref)
        assert got[-1].completion_tokens == n


def test_a_bad_request_in_a_prefill_group_fails_alone(setup):
    """A request the engine refuses (the server checks first; this is the loop's last guard) gets
    its error, and the request admitted with it is served; a bad ``prefill_groups`` is refused."""
    engine, target = setup["engine"], setup["target"]
    with pytest.raises(ValueError, match="prefill_groups must include 1"):
        sched.Scheduler(engine, target.tokenizer, prefill_groups=(2,))
    scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=2, warmup_widths=(16,)).start()
    assert scheduler.ready.wait(120)
    good, bad = [], []
    with scheduler.paused():
        for emit, settings in ((good.append, SlotSettings(temperature=0.0, max_new_tokens=4)),
                               (bad.append, SlotSettings(temperature=-1.0, max_new_tokens=4))):
            scheduler.submit(sched.Request(prompt=[5, 6, 7], settings=settings, emit=emit))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (good and isinstance(good[-1], sched.Done) and bad):
        time.sleep(0.02)
    scheduler.close(drain_seconds=5)
    assert isinstance(good[-1], sched.Done) and good[-1].completion_tokens == 4
    assert bad == [sched.Failed(bad[0].message, "invalid_request")] and "temperature" in bad[0].message


def test_refusals_that_need_another_server(setup):
    """A model without a chat template, and an engine built without logits processors (--no-penalties):
    the requests they cannot serve are refused with a 400 that says why (checked on the host, nothing compiles)."""
    import types

    from specjax._src.serve import api, schemas, validation

    bare_config = ServerConfig(MODEL, setup["target"].replace(chat_template=None))
    with pytest.raises(api.ApiError) as e:
        validation.chat_prompt([{"role": "user", "content": "hi"}], bare_config, CAPACITY, True)
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "no_chat_template")
    assert "chat template" in e.value.message
    bare = Engine(setup["pair"], num_slots=1, capacity=64, num_draft=K, controls=False)
    config = ServerConfig(MODEL, setup["target"])
    for field, value in (("presence_penalty", 0.5), ("logit_bias", {"5": 1.0}), ("min_tokens", 3)):
        body = schemas.CompletionRequest(model=MODEL, prompt=PROMPT, **{field: value})
        with pytest.raises(api.ApiError) as e:
            validation.request_settings(body, [5, 6], None, types.SimpleNamespace(engine=bare), config)
        assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported")
        assert "--no-penalties" in e.value.message
    body = schemas.CompletionRequest(model=MODEL, prompt=PROMPT, temperature=0.5, seed=3)
    settings, stop = validation.request_settings(body, [5, 6], None, types.SimpleNamespace(engine=bare), config)
    assert settings.controls is None and (settings.temperature, settings.seed, stop) == (0.5, 3, ())


def test_serve_names_the_extra_when_fastapi_is_missing(monkeypatch):
    import sys

    from specjax.cli import serve

    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[serve\]"'):
        serve._require_server_packages()


def test_cli_parses_serve(setup):
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    args = build_parser().parse_args(["serve", "--slots", "2", "--rule", "mars:theta=0.9", "--port", "0"])
    assert (args.slots, args.capacity, args.rule, args.host) == (2, None, "mars:theta=0.9", "127.0.0.1")
    # The default capacity fits the models' positions: the embedded pair's 256, less K.
    assert serve.default_capacity(setup["target"], setup["pair"].draft, K) == 256 - K
    for flags, message in ((["--tree", "2,1", "--num-draft", "3"], "the tree's depth \\(2\\) is its K"),
                           (["--tree", "2,1", "--lookup", "2"], "--lookup applies to chains"),
                           (["--tree", "2,1", "--drafting", "auto"], "auto chooses a dynamic tree's size"),
                           (["--tree", "dynamic:2,2,3", "--drafting", "heuristic"], "--drafting applies to chains"),
                           (["--tree", "2,x"], "--tree: tree '2,x'")):
        with pytest.raises(SystemExit, match=message):
            serve.build(build_parser().parse_args(["serve"] + flags))
    from specjax.cli import common

    sized = build_parser().parse_args(["serve", "--tree", "dynamic:2,2,3", "--drafting", "auto"])
    assert common.sizes_tree(sized) and common.drafting_policy(sized).name == "auto"


# Slow (3-4 minutes on a busy 2-core CPU); the slots engine's trees are checked in test_slots_trees.py.
@pytest.mark.slow
def test_serve_with_a_token_tree():
    """`specjax serve --tree`: each request drafts a token tree in its slot; greedy requests get what
    decode(tree=...) gives them alone with the rule they pick, penalties and logit_bias included,
    and the model card names the tree."""
    from specjax.cli import serve
    from specjax.cli.app import build_parser
    from specjax.trees import static_tree

    args = build_parser().parse_args(["serve", "--tree", "2,2,1", "--slots", "1", "--capacity", "64",
                                      "--rules", "sd,mars:theta=0.5", "--cycles-per-step", "2"])
    app, scheduler = serve.build(args)
    server = Server(app)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        target, tree = scheduler.engine.params.target, static_tree((2, 2, 1))
        assert scheduler.engine.tree == tree
        ids = target.tokenizer.encode(PROMPT).ids
        for rule, extra in ((speculative_sampling(), {}), (mars(theta=0.3), {"speculative": {"rule": "mars:theta=0.3"}})):
            r = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=20, temperature=0,
                                          extra_body=extra)
            ref = specjax.decode(scheduler.engine.params, [ids], tree=tree, max_new_tokens=20, temperature=0.0,
                                 rule=rule, max_length=64 + tree.num_nodes).to_lists()[0]
            assert r.choices[0].text == target.tokenizer.decode(ref), str(rule)
            assert r.model_extra["speculative"]["cycles"] < len(ref)  # the tree accepted drafts
        card = httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["speculative"]
        assert card["tree"] == "2,2,1" and card["num_draft"] == 3
        penalised = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=20, temperature=0,
                                              presence_penalty=0.5, frequency_penalty=0.4, logit_bias={"30": 5})
        controls = specjax.GenerationControls(presence_penalty=0.5, frequency_penalty=0.4, logit_bias={30: 5.0})
        ref = specjax.decode(scheduler.engine.params, [ids], tree=tree, max_new_tokens=20, temperature=0.0,
                             controls=controls, max_length=64 + tree.num_nodes).to_lists()[0]
        assert penalised.choices[0].text == target.tokenizer.decode(ref) != r.choices[0].text
    finally:
        server.stop()
    jax.clear_caches()


@pytest.mark.slow
def test_serve_sizes_a_dynamic_tree_with_auto():
    """`specjax serve --tree dynamic:... --drafting auto`: each cycle verifies the tree's best-ranked
    nodes that pay, or runs a plain step; a greedy request gets the target's own greedy tokens."""
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    args = build_parser().parse_args(["serve", "--tree", "dynamic:2,2,3", "--drafting", "auto", "--slots", "2",
                                      "--capacity", "64", "--cycles-per-step", "2"])
    app, scheduler = serve.build(args)
    assert scheduler.engine.drafting.name == "auto" and scheduler.live_costs is None
    server = Server(app)
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        target = scheduler.engine.params.target
        ids = target.tokenizer.encode(PROMPT).ids
        r = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=20, temperature=0)
        ref = specjax.generate(target, [ids], max_new_tokens=20, temperature=0.0).to_lists()[0]
        assert r.choices[0].text == target.tokenizer.decode(ref)
    finally:
        server.stop()
    jax.clear_caches()


def test_serve_keeps_its_programs_in_a_compilation_cache(tmp_path, monkeypatch):
    """``--compilation-cache``: by default the XDG cache directory (or $JAX_COMPILATION_CACHE_DIR),
    a directory given, or none; a path that cannot be a directory is a clear error."""
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        default = build_parser().parse_args(["serve"]).compilation_cache
        expected = tmp_path / "xdg" / "specjax" / "jax"
        assert serve.use_compilation_cache(default) == str(expected) and expected.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(expected)
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert serve.use_compilation_cache(None) == str(tmp_path / "env")
        args = build_parser().parse_args(["serve", "--compilation-cache", str(tmp_path / "mine")])
        assert serve.use_compilation_cache(args.compilation_cache) == str(tmp_path / "mine")
        assert serve.use_compilation_cache("none") is None
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")  # "none" set nothing
        (tmp_path / "file").write_text("not a directory")
        with pytest.raises(SystemExit, match="give a writable directory"):
            serve.use_compilation_cache(str(tmp_path / "file" / "cache"))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_real_pair_greedy_equals_decode():
    """The smollm2-eagle pair (a feature head) through the CLI's build and the openai client."""
    import argparse

    from specjax.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--pair", "smollm2-eagle", "--slots", "2", "--capacity", "256"])
    app, scheduler = serve.build(args)
    server = Server(app)
    try:
        server.wait_ready(600)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "Name three primary colors."}]
        r = client.chat.completions.create(model="smollm2-eagle", messages=messages, max_tokens=32, temperature=0)
        target = scheduler.engine.params.target
        ids = specjax.encode_chat(target, messages)
        ref = specjax.decode(scheduler.engine.params, [ids], num_draft=scheduler.engine.num_draft, max_new_tokens=32,
                             temperature=0.0, max_length=256 + scheduler.engine.num_draft).to_lists()[0]
        assert r.choices[0].message.content == target.tokenizer.decode(ref)
        assert r.model_extra["speculative"]["accepted"] > 0
    finally:
        server.stop()
    jax.clear_caches()


# ---------------------------------------------------------------------------
# What a hostile or careless client does, and the fields clients send
# ---------------------------------------------------------------------------


@pytest.fixture
def slow_steps(setup, monkeypatch):
    """Each engine step takes at least 50 ms more: long requests stay live for seconds."""
    engine, step = setup["engine"], setup["engine"].step

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", slow)


def wait_for(predicate, timeout: float = WAIT) -> bool:
    """Polls ``predicate`` until it holds (returning at once when it does) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_non_streaming_client_that_leaves_frees_its_slot(setup, slow_steps):
    """A client that times out (as the openai client's timeout does) cancels its request within
    a step or so, not after the request ran to its end."""
    url, scheduler = setup["url"], setup["scheduler"]
    before = scheduler.metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "min_tokens": 100, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=0.5)
    # The cancellation lands within a step or so of the client leaving; the counters, not the clock,
    # show it was cancelled rather than run to its end (requests_finished unchanged, below).
    assert wait_for(lambda: scheduler.metrics()["requests_cancelled"] == before["requests_cancelled"] + 1)
    after = scheduler.metrics()
    assert after["live_slots"] == 0 and after["requests_finished"] == before["requests_finished"]


def test_max_queue_zero_serves_while_a_slot_is_free(setup):
    engine, target = setup["engine"], setup["target"]
    scheduler = sched.Scheduler(engine, target.tokenizer, max_queue=0, num_cycles=2, warmup_widths=(16,)).start()
    assert scheduler.ready.wait(120)
    events = []
    with scheduler.paused():
        for _ in range(SLOTS):
            scheduler.submit(sched.Request(prompt=[5, 6], settings=SlotSettings(temperature=0.0, max_new_tokens=2),
                                           emit=events.append))
        with pytest.raises(sched.QueueFull):
            scheduler.submit(sched.Request(prompt=[5], settings=SlotSettings(max_new_tokens=2), emit=events.append))
    assert wait_for(lambda: sum(isinstance(e, sched.Done) for e in events) == SLOTS)
    scheduler.close(drain_seconds=5)


def test_tokenizing_runs_off_the_event_loop(setup, monkeypatch):
    """While a prompt is being tokenized, /health and other requests are answered."""
    from specjax._src.serve import validation

    url, tokenize = setup["url"], validation.completion_prompt
    tokenizing, release = threading.Event(), threading.Event()

    def held_tokenize(*args):  # tokenizing lasts until /health has answered (or WAIT passes)
        tokenizing.set()
        release.wait(WAIT)
        return tokenize(*args)

    monkeypatch.setattr(validation, "completion_prompt", held_tokenize)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=2 * WAIT)))
    thread.start()
    try:
        assert tokenizing.wait(WAIT)
        # Were the prompt tokenized on the event loop, /health could not answer before the release:
        # the request would time out (events, not a wall-clock bound, decide; a busy machine's
        # round trip fits in the timeout many times over).
        assert httpx.get(url + "/health", timeout=WAIT / 2).status_code == 200
    finally:
        release.set()
    thread.join(WAIT)
    assert result["r"].status_code == 200


def test_a_body_over_the_limit_gets_413(setup):
    url = setup["url"]
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10), "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=big, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while it is read
        yield b'{"model": "embedded", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_errors_outside_the_routes_have_openai_bodies(setup):
    url = setup["url"]
    cases = [(httpx.get(url + "/v1/nothing", timeout=5), 404, "not_found"),
             (httpx.get(url + "/v1/completions", timeout=5), 405, "method_not_allowed"),
             (httpx.post(url + "/v1/completions", content=b'{"model": "\xff\xfe"}', timeout=5), 400, "invalid_json"),
             (httpx.post(url + "/v1/completions", content=b"[" * 20_000 + b"]" * 20_000, timeout=5), 400,
              "invalid_json"),
             (httpx.post(url + "/v1/completions", content=b"[1, 2]", timeout=5), 400, "invalid_json"),
             (httpx.get(url + "/v1/models/gpt-4", timeout=5), 404, "model_not_found")]
    for r, status, code in cases:
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
        assert r.headers["x-request-id"]
    assert httpx.get(url + "/v1/models/" + MODEL, timeout=5).json()["id"] == MODEL


def test_request_ids(setup):
    url = setup["url"]
    r = httpx.get(url + "/v1/models", headers={"X-Request-Id": "trace-42"}, timeout=5)
    assert r.headers["x-request-id"] == "trace-42"
    a, b = (httpx.get(url + "/health", timeout=5).headers["x-request-id"] for _ in range(2))
    assert a and b and a != b
    bad = httpx.get(url + "/health", headers={"X-Request-Id": "has space"}, timeout=5).headers["x-request-id"]
    assert " " not in bad  # not echoed as given: a fresh id


def test_api_key_and_retry_after(setup):
    """--api-key guards /v1 (not /health); a warming server's 503 says when to retry."""
    from fastapi.testclient import TestClient

    engine, target = setup["engine"], setup["target"]
    unstarted = sched.Scheduler(engine, target.tokenizer)  # never started: warming up
    app = create_app(unstarted, ServerConfig(MODEL, target, api_key="sekret"))
    client = TestClient(app)  # no `with`: the lifespan (which would start the scheduler) does not run
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert client.get("/health").status_code == 503
    r = client.post("/v1/completions", headers={"Authorization": "Bearer sekret"},
                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and r.headers["retry-after"] == "5"


def test_vllm_fields_and_openai_limits_that_are_honoured(setup):
    client, target, pair = setup["client"], setup["target"], setup["pair"]
    ids = target.tokenizer.encode(PROMPT).ids
    ref = specjax.decode(pair, [ids], num_draft=K, max_new_tokens=40, temperature=0.0, eos_token_id=(),
                         max_length=CAPACITY + K).to_lists()[0]
    # ignore_eos: the full 40 tokens whatever the model says; stop_token_ids: ends at (and keeps) that token.
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 40 and full.choices[0].text == target.tokenizer.decode(ref)
    stop_at = ref[12]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop_at]})
    end = ref.index(stop_at) + 1
    assert cut.usage.completion_tokens == end and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == target.tokenizer.decode(ref[:end])
    # top_k -1 is vLLM's "off"; 300 logit_bias entries (OpenAI's limit) are taken.
    off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                    extra_body={"top_k": -1})
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3)
    assert off.choices[0].text == plain.choices[0].text
    bias = {str(t): 0.0 for t in range(300)}
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias=bias).usage
    # Harmless values of refused fields pass.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       response_format={"type": "text"}, tool_choice="none", user="u1")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_server_seed_makes_unseeded_requests_reproducible(setup):
    a, b, c = (ServerConfig(MODEL, setup["target"], seed=s) for s in (7, 7, 8))
    seeds = [[config.request_seed() for _ in range(3)] for config in (a, b, c)]
    assert seeds[0] == seeds[1] != seeds[2]
    unseeded = ServerConfig(MODEL, setup["target"])
    assert len({unseeded.request_seed() for _ in range(4)}) == 4


def test_n_choices_share_one_prefill(setup):
    """n choices: one prefill, choice i samples what decode samples for sequence i of n copies."""
    client, target, pair, scheduler = setup["client"], setup["target"], setup["pair"], setup["scheduler"]
    ids = target.tokenizer.encode(PROMPT).ids
    before = scheduler.metrics()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=2)
    after = scheduler.metrics()
    assert after["prefills"] == before["prefills"] + 1
    ref = specjax.decode(pair, [ids] * 2, num_draft=K, max_new_tokens=12, temperature=1.0, key=jax.random.key(5),
                         max_length=CAPACITY + K).to_lists()
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [target.tokenizer.decode(x) for x in ref]
    assert r.usage.completion_tokens == sum(map(len, ref))
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5)
    assert one.choices[0].text == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5,
                                            n=2, stream=True))
    for i in range(2):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) == r.choices[i].text


def test_echo(setup):
    client = setup["client"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == echoed.choices[0].text


def reference_logprobs(setup, prompt_ids, tokens, temperature=1.0, top_k=None):
    """log-softmax of the target's logits at each generated position, as target-only decoding's
    sampling sees them (temperature, then top-k; temperature 0: the raw logits)."""

    seq = [list(prompt_ids) + list(tokens)]
    logits = np.asarray(specjax.logits(setup["target"], seq)[0], np.float64)
    rows = logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(tokens)]
    if temperature > 0:
        rows = rows / temperature
    if top_k:
        kth = np.sort(rows, axis=-1)[:, -top_k][:, None]
        rows = np.where(rows >= kth, rows, -np.inf)
    rows = rows - rows.max(-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(-1, keepdims=True))


def test_logprobs_are_the_targets(setup):
    """Chat and completions, streamed or not: each token's log-probability is target-only
    log-softmax at its prefix, after the request's temperature and top-k; the alternatives are
    the most likely tokens."""

    client, target, pair, config = setup["client"], setup["target"], setup["pair"], setup["config"]
    ids = target.tokenizer.encode(PROMPT).ids
    for temperature, top_k in ((0.0, None), (0.7, 20)):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=temperature, seed=2,
                                      logprobs=3, extra_body={"top_k": top_k, "ignore_eos": True})
        # The tokens: what decode samples with the request's seed (the same text, checked).
        tokens = specjax.decode(pair, [ids], num_draft=K, max_new_tokens=16, temperature=temperature, top_k=top_k,
                                eos_token_id=(), key=jax.random.key(2), max_length=CAPACITY + K).to_lists()[0]
        assert r.choices[0].text == target.tokenizer.decode(tokens)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == r.usage.completion_tokens == 16
        assert lp.tokens == [config.token_text(t) for t in tokens]
        ref = reference_logprobs(setup, ids, tokens, temperature, top_k)
        chosen = ref[np.arange(len(tokens)), tokens]
        np.testing.assert_allclose(lp.token_logprobs, chosen, atol=2e-4)
        for row, alternatives in zip(ref, lp.top_logprobs):
            best = np.argsort(-row)[:3]
            assert sorted(alternatives.values(), reverse=True) == pytest.approx(row[best], abs=2e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        if temperature == 0.7:  # a negative control: the raw logits' log-softmax differs
            raw = reference_logprobs(setup, ids, tokens, 1.0)[np.arange(len(tokens)), tokens]
            assert np.abs(raw - chosen).max() > 1e-2
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the best is chosen
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    streamed_content = [c for ch in streamed if ch.choices and ch.choices[0].logprobs
                        for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed_content] == [(c.token, round(c.logprob, 5))
                                                                          for c in content]


def test_latency_histograms(setup):
    setup["client"].completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(setup["url"] + "/metrics", timeout=5).text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        buckets = [float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(f"specjax_{name}_bucket")]
        count = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"specjax_{name}_count"))
        assert count >= 1 and buckets == sorted(buckets) and buckets[-1] == count
        assert f'specjax_{name}_bucket{{le="+Inf"}}' in text


def test_speculation_is_reported_per_position_and_per_draft_length(setup):
    """A response's speculative block says what each draft position accepted and how many tokens each
    cycle drafted (what the drafting policy chose); /metrics sums both and histograms each choice's tau."""
    r = httpx.post(setup["url"] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                                           "temperature": 0}, timeout=WAIT).json()
    spec = r["speculative"]
    k = len(spec["accepted_at"])
    assert k >= 1 and len(spec["draft_lengths"]) == k + 1
    assert sum(spec["accepted_at"]) == spec["accepted"] and sum(spec["draft_lengths"]) == spec["cycles"]
    assert sum(n * count for n, count in enumerate(spec["draft_lengths"])) == spec["drafted"]
    assert spec["accepted_at"] == sorted(spec["accepted_at"], reverse=True)  # a run is accepted from the front
    text = httpx.get(setup["url"] + "/metrics", timeout=5).text
    assert 'specjax_accepted_at_position_total{position="1"}' in text
    assert 'specjax_draft_length_cycles_total{length="0"}' in text
    assert float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("specjax_request_tau_count"))) >= 1


def test_shutdown_refuses_the_waiting_and_ends_late_streams_with_an_error(setup, slow_steps, monkeypatch):
    """SIGTERM (uvicorn's should_exit): a request still waiting gets 503 at once; a stream that
    outlives the drain ends with an error event and [DONE], its connection still open."""
    engine, target = setup["engine"], setup["target"]
    # From the shutdown on, the engine's steps wait for `steps` (set once the drain is over): the
    # streams outlive the drain whatever the machine's speed, and the waiting request's 503 must
    # come before the drain ends (at once), not when it ends nor when the loop stops.
    steps, step = threading.Event(), engine.step
    steps.set()

    def held_step(*args, **kwargs):
        steps.wait(WAIT)
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", held_step)
    drain = 5.0  # the 503 must come well within it (it came in milliseconds on a quiet machine)
    scheduler = sched.Scheduler(engine, target.tokenizer, max_queue=4, num_cycles=2, warmup_widths=(16,))
    server = Server(create_app(scheduler, ServerConfig(MODEL, target)), drain_seconds=drain)
    server.wait_ready(120)
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "min_tokens": 100, "temperature": 0}
    streams, waiting = [], {}
    with httpx.Client(timeout=30) as http:
        for _ in range(SLOTS):
            streams.append(http.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}))
        lines = [s.__enter__().iter_lines() for s in streams]
        for it in lines:
            assert next(line for line in it if line.startswith("data: "))
        # Two wait for a slot, one of them streamed: both get 503 (a stream's status waits for its first event).
        threads = [threading.Thread(target=lambda key=key, body=body: waiting.update({key: httpx.post(
            server.url + "/v1/completions", json=body, timeout=2 * WAIT), key + "_drained": scheduler._stop}))
            for key, body in (("r", long), ("s", {**long, "stream": True}))]
        for thread in threads:
            thread.start()
        assert wait_for(lambda: scheduler.metrics()["queue_depth"] == 2)
        steps.clear()
        server.server.should_exit = True
        for thread in threads:
            thread.join(2 * WAIT)
        for key in ("r", "s"):
            assert waiting[key].status_code == 503 and waiting[key].json()["error"]["code"] == "shutting_down"
            assert waiting[key].headers["retry-after"]
            assert not waiting[key + "_drained"]  # refused before the drain ended, the streams still live
        assert wait_for(lambda: scheduler._stop)  # the drain is over: the streams' steps go on, to their end
        steps.set()
        for it, s in zip(lines, streams):
            rest = [line for line in it if line.startswith("data: ")]
            s.__exit__(None, None, None)
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["error"]["code"] == "shutting_down"
    server.thread.join(timeout=30)
    assert not server.thread.is_alive() and not scheduler._thread.is_alive()
    server.sock.close()


def test_serve_refuses_a_busy_or_impossible_port_at_once(monkeypatch):
    from specjax._src.serve.server import bind
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    # Before any model loads (the build is what loads them), whatever the machine's speed.
    monkeypatch.setattr(serve, "build", lambda args: pytest.fail("the models were built before the port was checked"))
    try:
        with pytest.raises(SystemExit, match="in use|another process"):
            serve.run(build_parser().parse_args(["serve", "--port", str(port)]))
    finally:
        busy.close()
    with pytest.raises(SystemExit, match="not a TCP port"):
        bind("127.0.0.1", 99999)
    with pytest.raises(SystemExit, match="--max-queue must be >= 0"):
        serve.check_args(build_parser().parse_args(["serve", "--max-queue", "-1"]))


def test_docs_list_every_field():
    """docs/server.md's compatibility table names every field the server honours, refuses or ignores."""
    from pathlib import Path

    from specjax._src.serve import fields, schemas

    doc = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    honoured = set(schemas.CompletionRequest.model_fields) | set(schemas.ChatRequest.model_fields)
    missing = [f for f in sorted(honoured | set(fields.REFUSED) | set(fields.IGNORED)) if f"`{f}`" not in doc]
    assert not missing, f"docs/server.md does not list {missing}"


def test_probe_findings_of_the_second_round(setup, slow_steps, monkeypatch):
    """What a second hostile probe found, each fixed: a queued client that leaves gives its place
    back; a body without surrogate escapes is not walked; a stop string across steps counts the
    same tokens whatever the steps; an empty completion still has a logprobs object; chat
    logprobs carry a byte-level token's own bytes; no /docs; no trailing-slash redirect."""
    from specjax._src.serve import validation

    url, scheduler = setup["url"], setup["scheduler"]
    # A client that leaves while queued: its place is free at once.
    before = scheduler.metrics()["requests_cancelled"]
    with scheduler.paused():
        threads = [threading.Thread(target=lambda: pytest.raises(httpx.ReadTimeout, httpx.post, url + "/v1/completions",
                                                                 json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                                                                 timeout=0.5)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert wait_for(lambda: scheduler.metrics()["queue_depth"] == 0)  # admission is held: only leaving frees it
    assert scheduler.metrics()["requests_cancelled"] == before + 2
    # A body with no \u escape of a surrogate is never walked.
    monkeypatch.setattr(validation, "check_strings", lambda obj: pytest.fail("walked a body without surrogate escapes"))
    junk = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "x": [{}] * 5000}
    assert httpx.post(url + "/v1/completions", json=junk, timeout=30).status_code == 200
    monkeypatch.undo()


def test_stop_strings_and_logprobs_count_the_completions_tokens(setup):
    client, target = setup["client"], setup["target"]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:30]  # a long stop string: found steps after its first tokens were generated
    counts = set()
    for num_draft in (0, K):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, logprobs=0,
                                      extra_body={"num_draft": num_draft, "ignore_eos": True})
        text, lp = r.choices[0].text, r.choices[0].logprobs
        assert text == full[:6] and r.choices[0].finish_reason == "stop"
        assert len(lp.tokens) == r.usage.completion_tokens
        assert "".join(lp.tokens).startswith(text)  # the tokens cover the text...
        assert not "".join(lp.tokens[:-1]).startswith(text)  # ...and none past what it needs
        counts.add(r.usage.completion_tokens)
    assert len(counts) == 1, counts  # the same tokens however the steps fell
    empty = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=full[:2],
                                      logprobs=0)
    assert empty.choices[0].text == "" and empty.choices[0].logprobs.tokens == []
    # min_tokens holds stop strings back too (vLLM's): the same stop string does not end it at once.
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=full[:2],
                                     extra_body={"min_tokens": 8, "ignore_eos": True})
    assert held.usage.completion_tokens >= 8 and held.choices[0].text.startswith(full[:2])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          temperature=0, logprobs=True, logit_bias={"97": 100})
    token = chat.choices[0].logprobs.content[0]
    assert target.tokenizer.id_to_token(97) == "\u00a1" and token.bytes == [0xA1]  # a raw byte, not U+FFFD's three


def test_routes_outside_the_api_are_errors(setup):
    url = setup["url"]
    for path in ("/docs", "/redoc", "/openapi.json", "/health/"):
        r = httpx.get(url + path, timeout=5, follow_redirects=False)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.status_code)
    big = b'{"model": "embedded", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    r = httpx.post(url + "/v1/completions", content=big, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"


def test_metrics_keep_every_digit():
    from specjax._src.serve.api import prometheus_text
    from specjax._src.serve.metrics import latency_histograms

    m = {key: 0 for key in ("requests_finished", "requests_failed", "requests_cancelled", "requests_refused",
                            "completion_tokens", "drafted", "accepted", "cycles", "steps", "prefills",
                            "prefilled_requests", "prefill_chunks", "queue_depth", "live_slots", "num_slots")}
    m.update(prompt_tokens=12345678, step_seconds=1234567.25, insert_seconds=0.0, busy_seconds=0.0, host_share=0.0,
             latency=latency_histograms())
    text = prometheus_text(m)
    assert "specjax_prompt_tokens_total 12345678\n" in text and "specjax_step_seconds_total 1234567.25\n" in text


def test_prompt_logprobs_are_the_targets_log_softmax(setup):
    """echo with logprobs, as lm-evaluation-harness' loglikelihood requests send it (token ids, several
    prompts, max_tokens 1 or 0, temperature 0): each prompt token's figure is target-only log-softmax at
    the tokens before it, the first token's null (vLLM's), and the generated token follows."""

    target, config = setup["target"], setup["config"]
    texts = [PROMPT + " return n", "x = [1, 2, 3]\nfor i in x:"]
    ids = [target.tokenizer.encode(text).ids for text in texts]
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}
    r = httpx.post(setup["url"] + "/v1/completions", json=body, timeout=WAIT).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == sum(map(len, ids)) and r["usage"]["completion_tokens"] == 2
    for choice, prompt in zip(r["choices"], ids):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1  # the prompt's, then the generated token's
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(prompt)] == [config.token_text(t) for t in prompt]
        assert choice["text"].startswith(target.tokenizer.decode(prompt))
        logits = np.asarray(specjax.logits(target, [prompt])[0], np.float64)
        ref = logits - logits.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        expected = ref[np.arange(len(prompt) - 1), prompt[1:]]
        got = np.array(lp["token_logprobs"][1: len(prompt)])
        np.testing.assert_allclose(got, expected, atol=2e-4)
        assert np.abs(got - ref[np.arange(len(prompt) - 1), prompt[:-1]]).max() > 0.1  # the wrong position: differs
        for i, top in enumerate(lp["top_logprobs"][1: len(prompt)]):
            assert sorted(top.values(), reverse=True) == pytest.approx(np.sort(ref[i])[::-1][:2], abs=2e-4)
            # What lm-eval's is_greedy compares: a token the target ranks first reports exactly its best figure.
            assert (lp["token_logprobs"][i + 1] == max(top.values())) == (int(np.argmax(ref[i])) == prompt[i + 1])
        generated = ref[len(prompt) - 1]
        assert lp["token_logprobs"][-1] == pytest.approx(generated.max(), abs=2e-4)  # greedy: the best token
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # max_tokens 0: the prompt's figures alone (no slot is taken), streamed the same.
    zero = httpx.post(setup["url"] + "/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 0},
                      timeout=WAIT).json()
    choice = zero["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["token_logprobs"]) == len(target.tokenizer.encode(PROMPT).ids)
    chunks = []
    with httpx.stream("POST", setup["url"] + "/v1/completions", json={**body, "prompt": PROMPT, "max_tokens": 0,
                                                                      "stream": True}, timeout=WAIT) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]


def test_several_prompts_in_one_request(setup):
    """A list of prompts: each its own choices, prompt by prompt (choice p * n + j), each the text it
    gets alone; usage counts each prompt once; streamed the same."""
    client = setup["client"]
    prompts = [PROMPT, "class Stack:", "x = [1, 2, 3]\nfor"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(4))
    for p, single in enumerate(alone[:2]):
        assert [r.choices[2 * p + j].text for j in range(2)] == [single.choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[:2])
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone[:2])
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {p: a.choices[0].text for p, a in enumerate(alone)}
    # More prompts than the queue and the slots hold: refused whole (429), none of them queued.
    before = setup["scheduler"].metrics()["prefilled_requests"]
    many = httpx.post(setup["url"] + "/v1/completions", json={"model": MODEL, "prompt": [PROMPT] * (SLOTS + MAX_QUEUE + 1),
                                                              "max_tokens": 2}, timeout=WAIT)
    assert many.status_code == 429 and setup["scheduler"].metrics()["prefilled_requests"] == before


def test_long_stop_lists(setup):
    """As many stop strings as lm-evaluation-harness' tasks send (vLLM takes any number): the first one
    that occurs ends the text."""
    client = setup["client"]
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = full[10:13]
    decoys = [f"@@{i}@@" for i in range(40)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=decoys + [stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_the_prefix_cache_in_the_server(setup):
    """A prompt sent again is read from the prefix cache (usage.prompt_tokens_details.cached_tokens),
    with the text it got cold; /metrics reports the hit rate, blocks and bytes; a server without a
    cache reports none cached. The CLI takes a budget, and --no-prefix-cache."""
    from specjax._src.engine.prefix_cache import PrefixCache
    from specjax.cli import serve
    from specjax.cli.app import build_parser

    engine, target = setup["engine"], setup["target"]
    cache = PrefixCache(64 * 2**20, namespace=MODEL)
    scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=2, warmup_widths=(16,), prefix_cache=cache,
                                eos_ids=[target.module.config.eos_token_id])
    server = Server(create_app(scheduler, ServerConfig(MODEL, target)))
    try:
        server.wait_ready(240)
        ids = (target.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1)\n" * 8).ids * 2)[:100]
        body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0}
        first, second = (httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT).json() for _ in "ab")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # one block: (100 - 2) // 64
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        m = metrics(server.url)
        assert m["specjax_prefix_cache_hit_tokens_total"] == 64 and m["specjax_prefix_cache_queried_tokens_total"] == 200
        assert m["specjax_prefix_cache_hit_rate"] == pytest.approx(64 / 200)
        # Block 0 whole and positions 64 .. 97 as a partial block (the second request resumed at 64
        # all the same: from 98 its prefill would still run one block).
        assert m["specjax_prefix_cache_blocks"] == 2 and 0 < m["specjax_prefix_cache_bytes"] <= 64 * 2**20
    finally:
        server.stop()
    plain = httpx.post(setup["url"] + "/v1/completions", json=body, timeout=WAIT).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert not any(name.startswith("specjax_prefix_cache") for name in metrics(setup["url"]))
    args = build_parser().parse_args(["serve", "--prefix-cache", "512MiB"])
    serve.check_args(args)
    assert args.prefix_cache == "512MiB" and not build_parser().parse_args(["serve"]).no_prefix_cache
    assert build_parser().parse_args(["serve", "--no-prefix-cache"]).no_prefix_cache
    with pytest.raises(SystemExit, match="--prefix-cache: 'lots' is not a size"):
        serve.check_args(build_parser().parse_args(["serve", "--prefix-cache", "lots"]))
