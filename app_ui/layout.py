"""The Gradio Blocks: components, then events. Callbacks receive the engine explicitly (they
close over the `engine` argument of `build_demo`); sessions live in one gr.State per visitor.

Events that generate share the concurrency group "generate" with a limit of 1: one generation
per loaded model at a time, the others wait in Gradio's queue and see their place in it.

API (README, API): /chat, /ab, /stop, /clear. Every callback tells `Visitors` that its session
is live; a cleared conversation's uploads are deleted (app_ui/visitors.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import gradio as gr
from gradio.components.multimodal_textbox import MultimodalData
from gradio.data_classes import FileData
from pydantic import field_validator, model_validator

from app_ui import queue_rules, views
from app_ui.served import Served, served_of
from app_ui.session import (Options, Session, Turn, answer, checked, drafter_for, messages_for, new_turn, question_of,
                            read_message)
from app_ui.stop_lane import leave_queue
from app_ui.visitors import Visitors
from engine import settings as schema
from engine.ab import ABProgress, run_ab
from engine.backend import Backend
from engine.engine import Engine, RequestError
from engine.images import ImageError

logger = logging.getLogger(__name__)

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples")
# (text, files): the bundled demo model answers each of these correctly (tests/test_app.py runs
# them); photographs only for other models, which can read them.
DEMO_EXAMPLES = [
    ("Describe the image.", ["scene.png"]),
    ("What does this chart show?", ["chart.png"]),
    ("Read the text in the image.", ["card.png"]),
    ("Which image has more shapes?", ["two_scenes_a.png", "two_scenes_b.png"]),
    ("How many purple shapes are there in all the images? Answer in a sentence.", ["count_a.png", "count_b.png"]),
]
PHOTO_EXAMPLES = [
    ("Describe this photo.", ["chelsea.png"]),
    ("What is in each picture?", ["chelsea.png", "rocket.jpg"]),
    ("What does this chart show?", ["chart.png"]),
]
TEXT_EXAMPLES = [  # a backend that reads no images (a llama.cpp model without its vision projector)
    ("What can you help me with?", []),
    ("Explain speculative decoding in two sentences.", []),
]
DEMO_NOTE = ("This demo model is tiny (3.6 M parameters, trained here from scratch): it knows only synthetic "
             "pictures of coloured shapes, bar charts and text cards like the examples, and gives confident "
             "nonsense about anything else.")
DEMO_SETTINGS_NOTE = ("The demo model reads every image as the same few tokens and was trained without a system "
                      "prompt, so those two settings are not offered. The app can serve a real VLM in its place "
                      "(see the README).")
SERVER_SETTINGS_NOTE = ("The server decides its own speculative decoding (its drafter and draft length are set where "
                        "it runs), and its own image sizes, so those settings are not offered here.")
AUTO_LABEL = "Auto: the drafter that has been fastest"
# Phones: the settings sidebar starts closed (Gradio opens it at any width). Wide screens: the
# message box has the focus (on a phone that would open the keyboard over the page).
ON_LOAD = """() => {
  if (window.innerWidth < 768) {
    const sidebar = document.querySelector('.sidebar.open');
    if (sidebar) sidebar.querySelector('.toggle-button').click();
  } else {
    document.querySelector('#chat-input textarea')?.focus({ preventScroll: true });
  }
}"""
FOCUS_INPUT = "() => { document.querySelector('#chat-input textarea')?.focus({ preventScroll: true }); }"
# Images dropped on the chat go into the message box, as if dropped there.
DROP_ON_CHAT = """() => {
  const chat = document.querySelector('#chatbot');
  if (!chat) return;
  chat.addEventListener('dragover', (event) => event.preventDefault());
  chat.addEventListener('drop', (event) => {
    const input = document.querySelector('#chat-input input[type=file]');
    const images = Array.from(event.dataTransfer?.files || []).filter((f) => f.type.startsWith('image/'));
    if (!input || !images.length) return;
    event.preventDefault();
    const files = new DataTransfer();
    images.forEach((f) => files.items.add(f));
    input.files = files.files;
    input.dispatchEvent(new Event('change', { bubbles: true }));
  });
}"""
GENERATE = {"concurrency_id": "generate", "concurrency_limit": 1}
INSTANT = {"concurrency_limit": None, "api_visibility": "private", "show_progress": "hidden"}  # quick, not limited
CHAT_HEIGHT = "min(560px, calc(100dvh - 290px))"  # the message box stays on the first screen, phones too
CSS = """
#header h2 { margin: 0 0 4px; }
#header p { margin: 0; font-size: var(--text-sm); color: var(--body-text-color-subdued); }
.stats table, .stats .table-wrap { width: 100%; font-size: 0.9em; border-collapse: collapse; border: none !important; }
.stats tr { border: none !important; }
.stats th, .stats td { border: none !important; border-bottom: 1px solid var(--border-color-primary) !important;
  background: transparent !important; padding: 4px 8px; text-align: left; vertical-align: top; }
.stats td:first-child, .stats th { white-space: nowrap; color: var(--body-text-color-subdued); font-weight: normal; }
#ab-table table { table-layout: fixed; }
#ab-table td, #ab-table th { overflow-wrap: anywhere; }
#ab-table td:first-child, #ab-table th:first-child { width: 30%; white-space: normal; }
.tokens { max-height: 360px; overflow-y: auto; }
.tokens .answer-text { white-space: pre-wrap; overflow-wrap: anywhere; line-height: 1.7; }
.tokens .legend { margin: 0 0 6px; font-size: var(--text-sm); color: var(--body-text-color-subdued); }
.tokens mark.draft { background: #bbf7d0; color: #14532d; border-radius: 3px; padding: 0; }
.dark .tokens mark.draft { background: #166534; color: #f0fdf4; }
@media (max-width: 767px) {
  #header h2 { font-size: 1.05rem; line-height: 1.3; padding-left: 36px; }
  #chatbot .placeholder-content { font-size: var(--text-sm); }
  #chatbot .examples { grid-template-columns: 1fr 1fr; gap: 6px; }
  #chatbot .example { padding: 6px 8px; }
  #chatbot .example-text { font-size: var(--text-sm); }
  #header p { display: none; }
  .sidebar:not(.open) .toggle-button { position: absolute; }
  #ab-answers { flex-direction: column; }
}
"""


def build_demo(engine: Engine | Served, gpu: Callable = lambda fn: fn, visitors: Visitors | None = None,
               ab_backend: Backend | None = None) -> gr.Blocks:
    """The app for `engine` (a loaded Engine, or any backend described by Served: app_ui/served.py;
    the callbacks get that description as `engine`). `ab_backend`: the A/B tab compares `engine`
    with it instead of plain with speculative decoding. `gpu` wraps every callback that generates
    (spaces.GPU on ZeroGPU). Launch it with `css=CSS`, and with `visitors`' Guard and lifespan
    (see app.py)."""
    engine, visitors = served_of(engine), visitors or Visitors()
    demo_model = engine.demo
    if not gr.utils.is_static_file(os.path.join(EXAMPLES_DIR, "chart.png")):  # once a process
        gr.set_static_paths([EXAMPLES_DIR])  # served from their own folder, never copied among the uploads
    examples = [{"text": text, "files": [os.path.join(EXAMPLES_DIR, f) for f in files]}
                for text, files in examples_for(engine)]
    # Gradio's own backstop: its files older than a day are deleted, checked hourly (Visitors deletes
    # unsent uploads after minutes, and a conversation's uploads when it is cleared or expires).
    with gr.Blocks(title="VLM chat · speculative decoding", fill_width=True, delete_cache=(3600, 86400)) as demo:
        session = gr.State(Session())  # copied for every visitor: a new, empty session each
        gr.Markdown(_header(engine), elem_id="header")
        with gr.Sidebar(label="Settings", open=True, width=300):
            gr.Markdown("### Settings")
            settings = _settings(engine)  # {Options field: its control}
        demo.load(None, js=ON_LOAD)
        demo.load(None, js=DROP_ON_CHAT)
        with gr.Tab("Chat"):
            chat = _chat_tab(examples, demo_model, engine.reads_images)
        with gr.Tab(f"A/B: {' vs '.join(ab_names(engine, ab_backend))}"):
            ab = _ab_tab(examples, engine, ab_backend)
        _wire_chat(engine, gpu, session, settings, chat, visitors, examples)
        _wire_ab(engine, gpu, session, {k: v for k, v in settings.items() if k != "mode"}, ab, visitors, ab_backend)
        _wire_api(engine, gpu, session, settings, visitors, ab_backend)
    return demo


def examples_for(served: Served) -> list[tuple[str, list[str]]]:
    """The examples the loaded model can answer: the demo model's own kind of pictures for it
    (whichever backend serves it), photographs for another model that reads images, text only
    for a backend that reads none (none for the demo model, which knows only its pictures)."""
    if not served.reads_images:
        return [] if served.demo else TEXT_EXAMPLES
    return DEMO_EXAMPLES if served.demo else PHOTO_EXAMPLES


def _chat_tab(examples: list[dict], demo_model: bool, reads_images: bool = True) -> SimpleNamespace:
    """The chat (examples inside it while it is empty: a click sends one), then the live
    statistics (beside it on a wide screen, below it on a phone, in a section that folds); the
    latest answer's highlight and plots appear with the first answer."""
    placeholder = ("Ask about one or more images: drop them here or add them with the clip button below."
                   if reads_images else "Ask a question: this model reads text only, not images.")
    if demo_model:
        placeholder += f"\n\n{DEMO_NOTE}"
    if examples:
        placeholder += "\n\n**Try an example** (a click sends it):"
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Chat", show_label=False, height=CHAT_HEIGHT, elem_id="chatbot",
                                 buttons=["copy"], placeholder=placeholder,
                                 examples=[{**example, "display_text": example["text"]} for example in examples] or None,
                                 group_consecutive_messages=False)
            message = _message_box("chat-input")
            with gr.Row():
                stop = gr.Button("Stop", variant="secondary", size="sm", elem_id="chat-stop", interactive=False)
                new_chat = gr.Button("New chat", size="sm", elem_id="chat-new")
        with gr.Column(scale=2):
            with gr.Accordion("Live statistics", open=True, elem_id="stats-section"):
                stats = gr.Markdown(views.stats_markdown(None), elem_id="stats", elem_classes=["stats"],
                                    container=True)
                with gr.Column(visible=False, elem_id="answer-details") as details:
                    tokens = gr.HTML(elem_id="tokens", elem_classes=["tokens"], container=True)
                    with gr.Accordion("Plots: acceptance by draft position, speed over the answer", open=False,
                                      elem_id="plots"):
                        acceptance_plot = gr.BarPlot(views.acceptance_frame(None), x="draft position",
                                                     y="acceptance", y_lim=[0, 1], height=220,
                                                     title="Acceptance by draft position")
                        speed_plot = gr.LinePlot(views.speed_frame([]), x="tokens", y="tok/s", height=220,
                                                 title="Decode tokens/s over the answer")
    return SimpleNamespace(chatbot=chatbot, message=message, stop=stop, new_chat=new_chat,
                           panels=[chatbot, stats, tokens, acceptance_plot, speed_plot, details])


def ab_names(served: Served, ab_backend: Backend | None) -> tuple[str, str]:
    """What the A/B tab compares: plain and speculative decoding, or two backends by name."""
    if ab_backend is None:
        return "plain", "speculative"
    return served.name, ab_backend.capabilities.name


def _ab_tab(examples: list[dict], served: Served, ab_backend: Backend | None) -> SimpleNamespace:
    """Message box and Stop, the examples, then the verdict over the full width, the two
    answers (side by side on a wide screen, one above the other on a phone) and the table."""
    if ab_backend is None and served.server_decides:
        gr.Markdown(f"*The server at `{served.name}` decides its own decoding, so there is no plain and speculative "
                    "run of it to compare here: start the app with `--ab-backend URL` to compare it with another "
                    "backend (docs/backends.md).*")
    elif ab_backend is None:
        gr.Markdown("One message (no chat history), answered plainly and then speculatively with the drafter from "
                    "the settings; each side's timings count only its own run. At temperature 0 the two answers "
                    "must be identical.")
    else:
        first, second = ab_names(served, ab_backend)
        how = "with the drafter from the settings" if not served.server_decides else "as it decodes"
        gr.Markdown(f"One message (no chat history), answered by **{first}** ({how}) and then by **{second}** (as it "
                    "decodes); each side's timings count only its own run. At temperature 0, with the same model "
                    "and weights, the two answers should be identical (compared as text when a backend gives no "
                    "token ids).")
    message = _message_box("ab-input")
    with gr.Row():
        stop = gr.Button("Stop", variant="secondary", size="sm", elem_id="ab-stop", interactive=False, scale=0,
                         min_width=160)
    if examples:
        gr.Examples(examples, inputs=[message], label="Examples (a click puts one in the message box)")
    verdict = gr.Markdown(views.ab_markdown(None), elem_id="ab-verdict", container=True)
    with gr.Row(equal_height=False, elem_id="ab-answers"):
        plain = gr.HTML(container=True, min_width=320, elem_id="ab-plain", elem_classes=["tokens"])
        speculative = gr.HTML(container=True, min_width=320, elem_id="ab-speculative", elem_classes=["tokens"])
    table = gr.Markdown(elem_id="ab-table", elem_classes=["stats"])
    return SimpleNamespace(message=message, stop=stop, panels=[verdict, plain, speculative, table])


def _wire_chat(engine: Served, gpu: Callable, session: gr.State, settings: dict, chat: SimpleNamespace,
               visitors: Visitors, examples: list[dict]) -> None:
    """Send (or click an example): check the message without opening its files (or refuse it,
    saying why, with the message left in the box), show it in the chat at once with Stop on,
    then prepare its images and answer it in the queue. The box stays open while an answer
    streams, and has the focus again when it ends."""
    demo_model = engine.demo

    def accept(message_value, session: Session, request: gr.Request):  # no outputs: a refusal is a toast
        visitors.touch(session, request.session_hash)
        with _user_errors():
            if session.pending is not None or session.running:
                raise RequestError("an answer is still streaming: wait for it, or press Stop (your message "
                                   "stays in the box)")
            session.check_not_expired(visitors.limits.idle_s)
            text, files = read_message(message_value, engine, session)
            _check_queue(request, visitors)  # the answer would be refused when it joins the queue: say so now
            _claim(visitors, session, files, request)
            visitors.spoke(session, request.session_hash)
            _start(session, Turn(text, files, [], arrived=_arrival(request)))

    def accept_example(event: gr.SelectData, session: Session, request: gr.Request):
        accept(examples[event.index], session, request)  # our own list: the click names only its place

    def show(session: Session, clear_box: bool = True):
        return (gr.MultimodalTextbox(value=None) if clear_box else gr.skip(), views.chatbot_messages(session),
                gr.Button(variant="stop", interactive=True), views.preparing(session.pending))

    def retry(session: Session, temperature, seed, request: gr.Request):
        """The last turn again; with sampling, from the next seed (the same seed gives the same answer;
        after 2**63 - 1 comes 0; a seed that is not one is left for the answer to name)."""
        visitors.touch(session, request.session_hash)
        if session.pending is None and session.turns:
            if _number(temperature) > 0:
                seed = _next_seed(seed)
            last = session.turns.pop()
            _start(session, Turn(last.text, last.files, last.images))
        # The panel says the new answer is on its way: the last one's figures would read as this one's.
        panel = views.preparing(session.pending) if session.pending is not None else gr.skip()
        return views.chatbot_messages(session), seed, gr.Button(variant="stop", interactive=True), panel

    def undo(session: Session):
        message = session.turns.pop().message if session.pending is None and session.turns else gr.skip()
        return message, *_panels(views.chatbot_messages(session))

    def new_conversation(session: Session):
        _clear(session, visitors)
        return None, *_panels([])

    @gpu
    def respond(session: Session, *values):
        visitors.touch(session)
        yield from _respond(engine, session, dict(zip(settings, values)), demo_model)

    # preprocess=False: the settings reach _respond as sent, which checks them and clears the turn
    # when one is wrong (Gradio's own check would refuse before the callback, leaving the turn pending).
    respond_event = dict(fn=respond, inputs=[session, *settings.values()], outputs=[*chat.panels, chat.message],
                         show_progress_on=[chat.chatbot], show_progress="minimal", api_visibility="private",
                         preprocess=False, **GENERATE)
    idle = dict(fn=lambda: gr.Button(variant="secondary", interactive=False), outputs=[chat.stop],
                js=FOCUS_INPUT, **INSTANT)
    shown = [chat.message, chat.chatbot, chat.stop, chat.panels[1]]  # the last: the statistics panel
    chat.message.submit(accept, [chat.message, session], None, **INSTANT) \
        .success(show, [session], shown, **INSTANT).success(**respond_event).then(**idle)
    chat.chatbot.example_select(accept_example, [session], None, **INSTANT) \
        .success(lambda session: show(session, clear_box=False), [session], shown, **INSTANT) \
        .success(**respond_event).then(**idle)
    chat.chatbot.retry(retry, [session, settings["temperature"], settings["seed"]],
                       [chat.chatbot, settings["seed"], chat.stop, chat.panels[1]], **INSTANT) \
        .success(**respond_event).then(**idle)
    chat.chatbot.undo(undo, [session], [chat.message, *chat.panels], **INSTANT)
    chat.new_chat.click(new_conversation, [session], [chat.message, *chat.panels], **INSTANT)
    chat.chatbot.clear(new_conversation, [session], [chat.message, *chat.panels], **INSTANT)
    chat.stop.click(_stopper(visitors), [session], None, queue=False, api_name="stop")


def _wire_ab(engine: Served, gpu: Callable, session: gr.State, settings: list, ab: SimpleNamespace,
             visitors: Visitors, ab_backend: Backend | None) -> None:
    """`settings` without the mode."""

    @gpu
    def ab_live(request: gr.Request, message_value, session: Session, *values):  # Gradio puts the request first
        visitors.touch(session, request.session_hash)
        options = Options(mode="speculative", **dict(zip(settings, values)))
        yield from _ab_live(engine, message_value, session, options, _arrival(request), ab_backend)

    running = dict(fn=lambda: gr.Button(variant="stop", interactive=True), outputs=[ab.stop], **INSTANT)
    idle = dict(fn=lambda: gr.Button(variant="secondary", interactive=False), outputs=[ab.stop], **INSTANT)
    # Like the chat's: once the run has taken the message, the box empties (the verdict shows what was
    # asked), so the next run's inputs are what the box then shows, never copies added to the last ones.
    # A refused message stays in the box.
    live = ab.message.submit(**running).then(ab_live, [ab.message, session, *settings.values()], ab.panels,
                                             show_progress_on=ab.panels[:1], api_visibility="private", **GENERATE)
    live.then(**idle)
    live.success(lambda: gr.MultimodalTextbox(value=None), None, [ab.message], **INSTANT)
    ab.stop.click(_stopper(visitors), [session], None, queue=False, api_visibility="private")


def _wire_api(engine: Served, gpu: Callable, session: gr.State, settings: list, visitors: Visitors,
              ab_backend: Backend | None) -> None:
    """The API-only endpoints /chat, /ab and /clear (/stop is the Stop button's); the
    settings schema names their parameters (engine/settings.py). Their inputs and outputs are hidden
    components. The message box takes any file type: Gradio's own type check would refuse a
    non-image file without naming it, our image validation names the file and the reason."""
    with gr.Row(visible=False):
        message = gr.MultimodalTextbox(file_count="multiple", label="message")
        message.data_model = ApiMessageData  # so that new_turn names a missing text or null files
        answer_text, statistics = gr.Textbox(label="answer"), gr.JSON(label="statistics")
        plain, speculative = gr.Textbox(label="plain"), gr.Textbox(label="speculative")
        speedup, identical = gr.Number(label="speedup"), gr.JSON(label="identical")  # true, false, null
        first_difference = gr.JSON(label="first_difference")
        trigger = gr.Button()

    # The settings are keyword inputs named by the schema (engine/settings.py): the API's parameters
    # are message, then every setting in the schema's order (/ab: all but the mode).
    @gpu
    def chat(message, session, request: gr.Request, **values):
        """Answer a message (text and image files) in this client's conversation; streams the answer
        text and the statistics."""
        visitors.touch(session, request.session_hash)
        yield from _api_chat(engine, message, session, Options(**values), _arrival(request), visitors,
                             request.session_hash, request)

    @gpu
    def ab(message, session, request: gr.Request, **values):
        """Answer one message (no history) plainly and speculatively: both answers, the decode speedup,
        whether they are identical and where they first differ (None when identical; both None when
        stopped)."""
        visitors.touch(session, request.session_hash)
        return _api_ab(engine, message, session, Options(mode="speculative", **values), _arrival(request), ab_backend)

    def clear(session):
        _clear(session, visitors)

    # preprocess=False: the values reach Options.checked as sent (a slider would refuse a value out of
    # its range without naming the parameter); the message's files are still checked by Gradio.
    trigger.click(chat, [message, session], [answer_text, statistics], api_name="chat", preprocess=False,
                  inputs_kwargs={name: settings[name] for name in schema.api_names()}, **GENERATE)
    trigger.click(ab, [message, session], [plain, speculative, speedup, identical, first_difference], api_name="ab",
                  inputs_kwargs={name: settings[name] for name in schema.api_names(mode=False)}, preprocess=False,
                  **GENERATE)
    trigger.click(clear, [session], None, api_name="clear", concurrency_limit=None)


class ApiMessageData(MultimodalData):
    """The API's message as sent: "text" may be missing or of any type and "files" null (as
    none), so that new_turn names what is wrong instead of Gradio failing without a message.
    Files are still Gradio's FileData: only files uploaded to this server are taken. With
    preprocess=False the callback gets this model's dict: {"text": ..., "files": [FileData dicts]}."""

    text: object = ""
    files: list[FileData] | object = []  # anything else reaches new_turn, which names it

    @model_validator(mode="before")
    @classmethod
    def _any_value_is_a_message(cls, message):
        """A bare string is the message's text (docs/app.md); any other value that is not a dict
        becomes the text too, for new_turn to name ("the text must be a string, not int")."""
        return message if isinstance(message, dict) or isinstance(message, cls) else {"text": message}

    @field_validator("files", mode="before")
    @classmethod
    def _none_is_no_files(cls, files):
        return [] if files is None else files


def _header(served: Served) -> str:
    title = "## Chat with a vision-language model, faster with speculative decoding\n\n"
    drafters = ", ".join(views.drafter_name(drafter.kind) for drafter in served.drafters.values())
    drafters = "as the server is configured" if served.server_decides else drafters or "none (plain decoding only)"
    images = f"up to {served.max_images} images per conversation"
    if served.engine is None:
        return title + f"Answers from `{served.name}` · speculative decoding: {drafters} · {images}"
    name = served.model.rstrip("/").rsplit("/", 2)
    return title + f"Model `{'/'.join(name[-2:])}` ({served.family}) · drafters: {drafters} · {images}"


def _settings(engine: Served) -> dict:
    """The request settings, keyed by Options' field names (the API's parameter names too); the
    drafter controls are off in plain mode. Settings that change nothing for the loaded model
    (or that the backend cannot honour: another backend's draft settings) are hidden, and a note
    says why."""
    descriptions = {key: views.DRAFTER_LABELS.get(drafter.kind, drafter.kind)
                    for key, drafter in engine.drafters.items()}
    choices = [(views.drafter_name(drafter.kind) + (" (default)" if key == engine.default_drafter else ""), key)
               for key, drafter in engine.drafters.items()] or [("none", "none")]
    if len(engine.drafters) > 1:  # engine/auto.py: per request, the drafter that has delivered the most
        descriptions["auto"] = AUTO_LABEL
        auto = ("Auto" + (" (default)" if engine.auto else ""), "auto")
        choices = [auto] + choices if engine.auto else choices + [auto]
    speculative = bool(engine.drafters)
    demo_model, image_tokens = engine.demo, engine.image_budget

    def describe(key: str) -> str:
        return descriptions.get(key, "").partition(": ")[2]

    settings = {
        "mode": gr.Radio(list(schema.MODES), value="speculative" if speculative else "plain", label=_label("mode")),
        "drafter": gr.Dropdown(choices, value=choices[0][1], label=_label("drafter"), interactive=speculative,
                               info=describe(choices[0][1])),
        "draft_tokens": _slider("draft_tokens", interactive=speculative),
        "adaptive": gr.Checkbox(schema.default("adaptive"), label=_label("adaptive"), interactive=speculative),
        "temperature": _slider("temperature"),
        "top_p": _slider("top_p"),
        "max_new_tokens": _slider("max_new_tokens"),
        "seed": gr.Number(schema.default("seed"), precision=0, label=_label("seed"),
                          info=schema.spec("seed").help + "; Retry takes the next"),
        "system_prompt": gr.Textbox(schema.default("system_prompt"), label=_label("system_prompt"), lines=2,
                                    visible=not demo_model),
        "max_image_tokens": gr.Slider(0, image_tokens or 4096, step=16, label=_label("max_image_tokens"),
                                      value=min(engine.max_image_tokens or 0, image_tokens or 0),
                                      info="0: the model's own limit", visible=image_tokens is not None),
        "draft_tree": _slider("draft_tree", interactive=speculative),
        "top_k": _slider("top_k"),
        "tree_branching": _slider("tree_branching", interactive=speculative),
    }
    assert list(settings) == schema.names(), "a control per setting, in the schema's order (the API's)"
    if demo_model:
        gr.Markdown(f"*{DEMO_SETTINGS_NOTE}*", elem_id="settings-note")
    _hide_what_the_backend_decides(engine, settings)
    drafter_controls = [settings[name] for name in ("drafter", "draft_tokens", "adaptive", "draft_tree",
                                                    "tree_branching")]
    settings["mode"].change(lambda mode: [gr.update(interactive=mode == "speculative" and speculative)] * 5,
                            [settings["mode"]], drafter_controls, **INSTANT)
    settings["drafter"].change(lambda key: gr.update(info=describe(key)), [settings["drafter"]],
                               [settings["drafter"]], **INSTANT)
    return settings


def _label(name: str) -> str:
    return schema.spec(name).label


def _slider(name: str, **options) -> gr.Slider:
    """A setting's slider: the schema's label, help, default and range (its UI range where narrower)."""
    meta = schema.spec(name)
    low, high, step = meta.ui or (meta.low, meta.high, 1)
    return gr.Slider(low, high, value=schema.default(name), step=step, label=meta.label, info=meta.help, **options)


def _hide_what_the_backend_decides(served: Served, settings: dict) -> None:
    """Another backend has no built-in draft settings; a server with no drafters to choose decides
    its own decoding, so it gets no mode or drafter either, and a note says so."""
    hidden = () if served.engine is not None else ("draft_tokens", "adaptive", "draft_tree", "tree_branching", "top_k")
    if served.server_decides:
        hidden += ("mode", "drafter")
        gr.Markdown(f"*{SERVER_SETTINGS_NOTE}*", elem_id="settings-note")
    for name in hidden:
        settings[name].visible = False  # before the page is built: Gradio reads it when it launches


def _message_box(elem_id: str) -> gr.MultimodalTextbox:
    return gr.MultimodalTextbox(file_types=["image"], file_count="multiple", show_label=False, elem_id=elem_id,
                                placeholder="Ask about the images… (drop, paste or upload several)")


@contextmanager
def _user_errors():
    """Request problems reach the user as gr.Error naming the file or limit; anything else is
    logged and reported as an internal error, never as a bare exception."""
    try:
        yield
    except (RequestError, ImageError) as error:
        raise gr.Error(str(error), print_exception=False) from None
    except gr.Error:
        raise
    except Exception as error:
        logger.exception("request failed")
        raise gr.Error(f"internal error: {type(error).__name__}: {error}") from error


def _without_named_files(message: dict, error: str) -> dict:
    """The message less the files that an ImageError names (its message starts with the file's name)."""
    files = [path for path in message["files"] if not error.startswith(os.path.basename(path) + ":")]
    return {"text": message["text"], "files": files}


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


async def _stop(session: Session, request: gr.Request, visitors: Visitors) -> None:
    """Stop the session's running answer, and let its answers still waiting in Gradio's queue
    run at once (each sees the stop and ends without an answer); a turn accepted whose answer
    neither waits nor runs (its respond step never came) is dropped, its files freed."""
    session.request_stop()
    await leave_queue(request, request.session_hash)
    blocks = _blocks_of(request)
    if session.pending is not None and not session.running and blocks is not None \
            and request.session_hash not in queue_rules.sessions(blocks, GENERATE["concurrency_id"]):
        visitors.release(session, session.drop_pending())


def _stopper(visitors: Visitors):
    """The Stop buttons' callback."""
    async def stop(session: Session, request: gr.Request) -> None:
        await _stop(session, request, visitors)
    return stop


def _blocks_of(request: gr.Request | None):
    """The Blocks serving `request`, or None (a test calling the handler)."""
    app = getattr(getattr(request, "request", None), "app", None)
    return app.get_blocks() if hasattr(app, "get_blocks") else None


def _check_queue(request: gr.Request | None, visitors: Visitors) -> None:
    """RequestError when an answer of this session, from this address, may not join the queue
    now (app_ui/queue_rules.py: one waiting per conversation, a few per address)."""
    blocks = _blocks_of(request)
    state = getattr(getattr(request, "request", None), "state", None)
    if blocks is None or state is None:
        return
    refusal = queue_rules.refusal(blocks, GENERATE["concurrency_id"], request.session_hash,
                                  getattr(state, "client", None), visitors.limits.answers_per_client)
    if refusal:
        raise RequestError(refusal)


def _clear(session: Session, visitors: Visitors) -> None:
    """A new conversation; a running or waiting answer stops and is not kept; the old
    conversation's uploads are deleted (unless another conversation holds them)."""
    files = session.files()
    session.clear()
    visitors.release(session, files)


def _next_seed(seed):
    """The seed after `seed`, wrapping at 2**63; no change (gr.skip) when `seed` is not a whole
    number from 0 to 2**63 - 1: the answer then names it."""
    if isinstance(seed, (int, float)) and not isinstance(seed, bool) and math.isfinite(seed) and seed == int(seed) \
            and 0 <= seed < 2**63:
        return (int(seed) + 1) % 2**63
    return gr.skip()


def _claim(visitors: Visitors, session: Session, files: list[str], request: gr.Request | None) -> None:
    """The session holds `files` now; RequestError names one that is not the visitor's own upload
    (the Guard refuses those before Gradio reads the request; this holds without it too)."""
    state = getattr(getattr(request, "request", None), "state", None)
    refused = visitors.claim(session, files, getattr(state, "visitor", None))
    if refused is not None:
        raise RequestError(f"{os.path.basename(refused)}: not a file you uploaded to this server; upload it again")


def _arrival(request: gr.Request | None) -> float:
    """When the request reached the server (stamped by visitors.Guard), else now."""
    state = getattr(getattr(request, "request", None), "state", None)
    return getattr(state, "arrived", None) or time.perf_counter()


def _start(session: Session, turn: Turn) -> None:
    session.pending = turn


def _respond(engine: Engine | Served, session: Session, options: Options | dict, demo_model: bool = False):
    """Prepare the pending turn's images, then stream its answer into the chat panels (and,
    last, the message box), throttled; plots less often. A refused turn (an unreadable image, a
    prompt too long for the context) goes back into the message box, less a refused file, with
    the reason in a notice; the conversation is unchanged. A turn stopped before it started, or
    that failed, is shown with the reason. A chat cleared meanwhile gets empty panels. `options`
    as sent (a dict: the page sends them unprocessed), checked here: a bad one is refused like a
    bad image, and the turn is cleared whatever fails."""
    turn, history, engine = session.pending, session.turns, served_of(engine)
    if turn is None:
        return
    turn.queue_wait_s = time.perf_counter() - turn.arrived
    text_tick, plot_tick = views.Throttle(views.UPDATES_PER_SECOND), views.Throttle(views.PLOT_UPDATES_PER_SECOND)
    side, points, returned = None, [], gr.skip()
    plain_tok_s = session.plain_speed_for(turn)
    kinds = {key: drafter.kind for key, drafter in engine.drafters.items()}

    def statistics(stats):
        hint = demo_model and views.asked_without_a_picture(session)
        return views.stats_markdown(stats, plain_tok_s, session.dropped, hint, kinds)

    try:
        options = checked(Options(**options) if isinstance(options, dict) else options, engine)
        _prepare_images(engine, session, turn)
        for side in answer(engine, session, turn, options):
            if side.stats.decode_tokens:
                points.append((side.stats.new_tokens, round(side.stats.decode_tok_s, 2)))
            if side.text and session.turns is history and text_tick.ready():
                plots = plot_tick.ready()
                yield _panels(views.chatbot_messages(session, side), side, statistics(side.stats),
                              points if plots else None) + (gr.skip(),)
        if side is not None and not side.stats.new_tokens:
            turn.error = "stopped before the answer started; nothing was answered (Retry sends it again)"
            history.append(turn)
    except (RequestError, ImageError) as error:
        returned = _without_named_files(turn.message, str(error))
        kept = "your text stays" if len(returned["files"]) < len(turn.files) else "your message is back in the box"
        gr.Warning(f"Cannot answer: {error} ({kept}).")
    except Exception as error:
        logger.exception("generation failed")
        turn.error = f"generation failed ({type(error).__name__}: {error}); the conversation is kept, try again"
        history.append(turn)
    finally:
        session.pending = None
    messages = views.chatbot_messages(session)
    if session.turns is not history:  # New chat while it ran: the stopped answer is not shown
        yield _panels(messages) + (returned,)
    elif side is None or not side.text:  # nothing answered: the panels keep the latest answer
        answered = session.answered()
        latest = statistics(answered[-1].stats) if answered else views.stats_markdown(None)
        yield (messages, latest, *[gr.skip()] * (len(_panels([])) - 2), returned)
    else:
        yield _panels(messages, side, statistics(side.stats), points) + (returned,)


def _prepare_images(engine: Served, session: Session, turn: Turn) -> None:
    """Open and shrink the turn's images (a turn shown at once has its files only)."""
    if turn.files and not turn.images:
        prepared = new_turn(turn.message, engine, session)
        turn.images, turn.load_s = prepared.images, prepared.load_s


def _panels(messages: list[dict], side=None, statistics: str | None = None,
            points: list[tuple[int, float]] | None = ()) -> tuple:
    """The chat panels' values: chat, statistics (views.stats_markdown's text; None: the empty
    panel's), highlight, the two plots (points None: left as they are) and the column holding
    the last three (shown once there is an answer)."""
    stats = side.stats if side else None
    if points is None:
        plots = (gr.skip(), gr.skip())
    else:
        drafted = bool(stats and stats.drafted)
        speed_max = max([10] + [tokens for tokens, _ in points])
        plots = (gr.update(value=views.acceptance_frame(stats), visible=drafted),
                 gr.update(value=views.speed_frame(list(points)), x_lim=[0, speed_max]))
    return (messages, statistics or views.stats_markdown(None), views.highlight_html(side), *plots,
            gr.Column(visible=bool(side and side.text)))


def _api_chat(engine: Served, message_value, session: Session, options: Options, arrived: float,
              visitors: Visitors, session_id: str | None = None, request: gr.Request | None = None):
    """/chat: (answer text, statistics dict), streamed; the turn joins the session's history. A
    request stopped while it waited in the queue answers "" with finish_reason "stopped"."""
    waited, tick = time.perf_counter() - arrived, views.Throttle(views.UPDATES_PER_SECOND)
    with _user_errors():
        session.check_not_expired(visitors.limits.idle_s)
        options = checked(options, engine)
        turn = new_turn(message_value, engine, session)
        turn.arrived, turn.queue_wait_s = arrived, waited
        _claim(visitors, session, turn.files, request)
        visitors.spoke(session, session_id)
        for side in answer(engine, session, turn, options):
            if tick.ready():
                yield side.text, _public_stats(engine, side.stats, session.dropped, waited)
    yield side.text, _public_stats(engine, side.stats, session.dropped, waited)


def _public_stats(engine: Served, stats, dropped: int, queue_wait_s: float = 0.0) -> dict:
    """views.stats_dict, the drafter named by its key (e.g. "text"), never by the folder it was loaded from,
    and `queue_wait_s`: from the send to the answer's start, part of `prepare_s` and `ttft_s`."""
    values = {**views.stats_dict(stats, dropped), "queue_wait_s": round(queue_wait_s, 4)}
    keys = {getattr(drafter, "name", key): key for key, drafter in engine.drafters.items()}
    values["drafter"] = keys.get(values["drafter"], values["drafter"] and os.path.basename(str(values["drafter"])))
    return values


def _ab_events(engine: Served, message_value, session: Session, options: Options, arrived: float,
               ab_backend: Backend | None):
    """run_ab on one message (no chat history), with a stop flag that Stop sets (also while the
    request waits in the queue); against `ab_backend` when there is one."""
    options = checked(options, engine)
    if engine.server_decides and ab_backend is None:
        raise RequestError(f"the server at {engine.name} decides its own decoding, so there is no plain and "
                           "speculative run to compare; start the app with --ab-backend URL to compare it with "
                           "another backend")
    turn = new_turn(message_value, engine)
    messages = messages_for(Session(), turn, options.system_prompt)
    drafter = drafter_for(options, engine) if engine.drafters else None  # run_ab says why None cannot do
    stop, session.running = session.begin(arrived), True
    try:
        for event in run_ab(engine.backend, messages, drafter, options.sampling(), options.decode(), stop,
                            options.max_image_tokens, against=ab_backend):
            if not isinstance(event, ABProgress) and not event.stopped and event.plain.stats.speed_measured:
                session.plain_tok_s, session.plain_question = event.plain.stats.decode_tok_s, question_of(turn)
            yield event
    finally:
        session.running = False


def _ab_live(engine: Served, message_value, session: Session, options: Options, arrived: float,
             ab_backend: Backend | None):
    tick, names = views.Throttle(views.UPDATES_PER_SECOND), ab_names(engine, ab_backend)
    with _user_errors():
        asked = views.asked(*read_message(message_value, engine))
        for event in _ab_events(engine, message_value, session, options, arrived, ab_backend):
            done = not isinstance(event, ABProgress)
            if done or tick.ready():
                verdict = asked + views.ab_markdown(event if done else None, None if done else event.running, names)
                first = (views.plain_html(event.plain.text) if ab_backend is None
                         else views.highlight_html(event.plain, names[0]))
                yield (verdict, first, views.highlight_html(event.speculative, "Speculative" if ab_backend is None else names[1]),
                       views.ab_table(event.plain.stats, event.speculative.stats, names))


def _api_ab(engine: Served, message_value, session: Session, options: Options, arrived: float,
            ab_backend: Backend | None):
    """/ab: plain answer, speculative answer, speedup, identical, first difference (or None);
    stopped: speedup, identical and first difference are None."""
    with _user_errors():
        *_, result = _ab_events(engine, message_value, session, options, arrived, ab_backend)
    difference = result.as_dict()["first_difference"]
    identical = None if result.identical is None else json.dumps(result.identical)  # gr.JSON reads "true"
    return result.plain.text, result.speculative.text, result.decode_speedup, identical, difference
