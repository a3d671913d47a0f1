"""The Gradio Blocks: components, then events. Callbacks receive the engine explicitly (they
close over the `engine` argument of `build_demo`); sessions live in one gr.State per visitor.

Events that generate share the concurrency group "generate" with a limit of 1: one generation
per loaded model at a time, the others wait in Gradio's queue and see their place in it.

API (see the README): /chat, /ab, /stop, /clear.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace

import gradio as gr

from app_ui import views
from app_ui.session import Options, Session, Turn, answer, messages_for, new_turn
from engine.ab import ABProgress, run_ab
from engine.engine import Engine, RequestError
from engine.images import ImageError

logger = logging.getLogger(__name__)

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "examples")
EXAMPLES = [  # (text, files): the demo model's synthetic pictures first, then photographs for real VLMs
    ("Describe each image.", ["two_scenes_a.png", "two_scenes_b.png"]),
    ("Describe the image.", ["scene.png"]),
    ("What does this chart show?", ["chart.png"]),
    ("Read the text in the image.", ["card.png"]),
    ("How many purple shapes are there in all the images? Answer in a sentence.", ["count_a.png", "count_b.png"]),
    ("What is in each picture?", ["chelsea.png", "rocket.jpg"]),
]
DRAFT_COLOUR = "#86efac"  # accepted draft tokens
GENERATE = {"concurrency_id": "generate", "concurrency_limit": 1}
INSTANT = {"concurrency_limit": None, "api_visibility": "private", "show_progress": "hidden"}  # quick, not limited
# .tokens: a HighlightedText shown as running text. Gradio puts whitespace nodes and padding
# between the spans; font-size 0 hides the whitespace, so the tint moves to the text itself.
CSS = """
.stats table { width: 100%; font-size: 0.9em; }
.stats td:first-child { white-space: nowrap; }
#tokens { max-height: 360px; overflow-y: auto; }
.tokens .textfield, .tokens .token-container, .tokens .token {
  font-size: 0; margin: 0 !important; padding: 0 !important;
}
.tokens .text { font-size: var(--text-md); line-height: 1.7; white-space: pre-wrap; padding: 0 !important; }
.tokens .token.highlighted .text { background: DRAFT_COLOUR; border-radius: 3px; }
""".replace("DRAFT_COLOUR", DRAFT_COLOUR)


def build_demo(engine: Engine, gpu: Callable = lambda fn: fn) -> gr.Blocks:
    """The app for `engine`. `gpu` wraps every callback that generates (spaces.GPU on ZeroGPU).
    Launch it with `css=CSS`."""
    examples = [{"text": text, "files": [os.path.join(EXAMPLES_DIR, f) for f in files]} for text, files in EXAMPLES]
    # Uploaded files older than a day are deleted, checked hourly: the upload folder stays bounded.
    with gr.Blocks(title="VLM chat · speculative decoding", fill_width=True, delete_cache=(3600, 86400)) as demo:
        session = gr.State(Session())  # copied for every visitor: a new, empty session each
        gr.Markdown(_header(engine))
        with gr.Sidebar(label="Settings", open=True, width=300):
            gr.Markdown("### Settings")
            settings = _settings(engine)  # Options' fields in order: mode first
        with gr.Tab("Chat"):
            chat = _chat_tab(examples)
        with gr.Tab("A/B: plain vs speculative"):
            ab = _ab_tab(examples)
        _wire_chat(engine, gpu, session, settings, chat)
        _wire_ab(engine, gpu, session, settings[1:], ab)
        _wire_api(engine, gpu, session, settings)
    return demo


def _chat_tab(examples: list[dict]) -> SimpleNamespace:
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Chat", height=540, elem_id="chatbot", buttons=["copy"],
                                 placeholder="Drop one or more images and ask a question.")
            message = _message_box("chat-input")
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", size="sm", elem_id="chat-stop")
                new_chat = gr.Button("New chat", size="sm", elem_id="chat-new")
            gr.Examples(examples, inputs=[message], label="Examples (click, then send)")
        with gr.Column(scale=2):
            stats = gr.Markdown(views.stats_markdown(None), elem_id="stats", elem_classes=["stats"], container=True)
            tokens = gr.HighlightedText(label="Latest answer, by where each token came from", elem_id="tokens",
                                        elem_classes=["tokens"],
                                        color_map={views.DRAFT_LABEL: DRAFT_COLOUR}, show_legend=True)
            acceptance_plot = gr.BarPlot(views.acceptance_frame(None), x="draft position", y="acceptance",
                                         y_lim=[0, 1], title="Acceptance by draft position", height=220)
            speed_plot = gr.LinePlot(views.speed_frame([]), x="tokens", y="tok/s",
                                     title="Decode tokens/s over the answer", height=220)
    return SimpleNamespace(chatbot=chatbot, message=message, stop=stop, new_chat=new_chat,
                           panels=[chatbot, stats, tokens, acceptance_plot, speed_plot])


def _ab_tab(examples: list[dict]) -> SimpleNamespace:
    gr.Markdown("One message (no chat history), decoded plainly and then speculatively with the drafter "
                "from the settings; each side's timings count only its own run. With greedy sampling "
                "(temperature 0) the two answers must be identical.")
    message = _message_box("ab-input")
    with gr.Row():
        verdict = gr.Markdown(views.ab_markdown(None), elem_id="ab-verdict", container=True)
        stop = gr.Button("Stop", variant="stop", size="sm", elem_id="ab-stop", scale=0, min_width=120)
    with gr.Row(equal_height=False):
        plain = gr.Textbox(label="Plain", lines=6, max_lines=16, interactive=False)
        speculative = gr.HighlightedText(label="Speculative", elem_classes=["tokens"],
                                         color_map={views.DRAFT_LABEL: DRAFT_COLOUR}, show_legend=True)
    table = gr.Markdown(elem_id="ab-table", elem_classes=["stats"])
    gr.Examples(examples, inputs=[message], label="Examples (click, then send)")
    return SimpleNamespace(message=message, stop=stop, panels=[verdict, plain, speculative, table])


def _wire_chat(engine: Engine, gpu: Callable, session: gr.State, settings: list, chat: SimpleNamespace) -> None:
    """Send: accept the message (or refuse it, saying why), show it at once, then answer it in the
    queue."""

    def accept(message_value, session: Session):  # no outputs: a refusal is a toast, not an overlay
        with _user_errors():
            _start(session, new_turn(message_value, engine, session))

    def show(session: Session):
        return gr.MultimodalTextbox(value=None, interactive=False), views.chatbot_messages(session)

    def retry(session: Session):
        if session.pending is None and session.turns:
            last = session.turns.pop()
            _start(session, Turn(last.text, last.files, last.images))
        return gr.MultimodalTextbox(interactive=session.pending is None), views.chatbot_messages(session)

    def undo(session: Session):
        if session.pending is None and session.turns:
            return session.turns.pop().message, views.chatbot_messages(session)
        return gr.skip(), views.chatbot_messages(session)

    def new_conversation(session: Session):
        _clear(session)
        return [], views.stats_markdown(None), [], views.acceptance_frame(None), views.speed_frame([])

    @gpu
    def respond(session: Session, *values):
        yield from _respond(engine, session, Options(*values))

    respond_event = dict(fn=respond, inputs=[session, *settings], outputs=chat.panels,
                         show_progress_on=[chat.chatbot], api_visibility="private", **GENERATE)
    unlock = dict(fn=lambda: gr.MultimodalTextbox(interactive=True), outputs=[chat.message], **INSTANT)
    chat.message.submit(accept, [chat.message, session], None, **INSTANT) \
        .success(show, [session], [chat.message, chat.chatbot], **INSTANT) \
        .success(**respond_event).then(**unlock)
    chat.chatbot.retry(retry, [session], [chat.message, chat.chatbot], **INSTANT) \
        .success(**respond_event).then(**unlock)
    chat.chatbot.undo(undo, [session], [chat.message, chat.chatbot], **INSTANT)
    chat.new_chat.click(new_conversation, [session], chat.panels, **INSTANT)
    chat.chatbot.clear(new_conversation, [session], chat.panels, **INSTANT)
    chat.stop.click(_stop, [session], None, queue=False, api_name="stop")


def _wire_ab(engine: Engine, gpu: Callable, session: gr.State, settings: list, ab: SimpleNamespace) -> None:
    """`settings` without the mode."""

    @gpu
    def ab_live(message_value, session: Session, *values):
        yield from _ab_live(engine, message_value, session, Options("speculative", *values))

    ab.message.submit(ab_live, [ab.message, session, *settings], ab.panels, show_progress_on=ab.panels[:1],
                      api_visibility="private", **GENERATE)
    ab.stop.click(_stop, [session], None, queue=False, api_visibility="private")


def _wire_api(engine: Engine, gpu: Callable, session: gr.State, settings: list) -> None:
    """The API-only endpoints /chat, /ab and /clear (/stop is the Stop button's); explicit
    signatures name the parameters for API clients. Their inputs and outputs are hidden
    components. The message box takes any file type: Gradio's own type check would refuse a
    non-image file without naming it, our image validation names the file and the reason."""
    with gr.Row(visible=False):
        message = gr.MultimodalTextbox(file_count="multiple", label="message")
        answer_text, statistics = gr.Textbox(label="answer"), gr.JSON(label="statistics")
        plain, speculative = gr.Textbox(label="plain"), gr.Textbox(label="speculative")
        speedup, identical = gr.Number(label="speedup"), gr.Checkbox(label="identical")
        first_difference = gr.JSON(label="first_difference")
        trigger = gr.Button()

    @gpu
    def chat(message, mode, drafter, draft_tokens, adaptive, temperature, top_p, max_new_tokens, seed,
             system_prompt, draft_tree, session):
        """Answer a message (text and image files) in this client's conversation; streams the answer
        text and the statistics."""
        options = Options(mode, drafter, draft_tokens, adaptive, temperature, top_p, max_new_tokens, seed,
                          system_prompt, draft_tree)
        yield from _api_chat(engine, message, session, options)

    @gpu
    def ab(message, drafter, draft_tokens, adaptive, temperature, top_p, max_new_tokens, seed, system_prompt,
           draft_tree, session):
        """Answer one message (no history) plainly and speculatively: both answers, the decode speedup,
        whether they are identical and where they first differ (None when identical)."""
        options = Options("speculative", drafter, draft_tokens, adaptive, temperature, top_p, max_new_tokens,
                          seed, system_prompt, draft_tree)
        return _api_ab(engine, message, session, options)

    trigger.click(chat, [message, *settings, session], [answer_text, statistics], api_name="chat", **GENERATE)
    trigger.click(ab, [message, *settings[1:], session], [plain, speculative, speedup, identical,
                                                            first_difference], api_name="ab", **GENERATE)
    trigger.click(_clear, [session], None, api_name="clear", concurrency_limit=None)


def _header(engine: Engine) -> str:
    drafters = ", ".join(f"`{key}` ({d.kind})" for key, d in engine.drafters.items()) or "none (plain decoding only)"
    name = engine.target.name.rstrip("/").rsplit("/", 2)
    return (f"## Chat with a vision-language model, faster with speculative decoding\n"
            f"Target `{'/'.join(name[-2:])}` ({engine.target.family.name}) · drafters: {drafters} · "
            f"up to {engine.max_images} images per conversation. The panel beside the chat updates live.")


def _settings(engine: Engine) -> list:
    """The request settings, in the order of `Options`' fields (the API's parameters too)."""
    choices = [(f"{key} · {drafter.kind}", key) for key, drafter in engine.drafters.items()] or [("none", "none")]
    defaults = Options()
    return [
        gr.Radio(["speculative", "plain"], value="speculative" if engine.drafters else "plain", label="Decoding"),
        gr.Dropdown(choices, value=choices[0][1], label="Drafter"),
        gr.Slider(1, 8, value=defaults.draft_tokens, step=1, label="Draft length (tokens per draft)"),
        gr.Checkbox(defaults.adaptive, label="Adaptive draft length"),
        gr.Slider(0, 1.5, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)"),
        gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="Top-p"),
        gr.Slider(1, 1024, value=defaults.max_new_tokens, step=1, label="Max new tokens"),
        gr.Number(defaults.seed, precision=0, label="Seed (sampling)"),
        gr.Textbox(defaults.system_prompt, label="System prompt (optional)", lines=2),
        gr.Slider(0, 16, value=defaults.draft_tree, step=1, label="Draft tree nodes (0 = one chain; else branches "
                                                                  "verified in one pass)"),
    ]


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


def _stop(session: Session) -> None:
    session.stop.set()


def _clear(session: Session) -> None:
    """A new conversation; a running answer stops and is not kept."""
    session.stop.set()
    session.turns = []


def _start(session: Session, turn: Turn) -> None:
    session.pending = turn
    session.stop.clear()


def _respond(engine: Engine, session: Session, options: Options):
    """Stream the pending turn's answer into the chat panels, throttled; plots less often."""
    tokenizer, turn = engine.target.tokenizer, session.pending
    if turn is None:
        return
    text_tick, plot_tick = views.Throttle(views.UPDATES_PER_SECOND), views.Throttle(views.PLOT_UPDATES_PER_SECOND)
    side, points = None, []
    try:
        for side in answer(engine, session, turn, options):
            if side.stats.decode_tokens:
                points.append((side.stats.new_tokens, round(side.stats.decode_tok_s, 2)))
            if text_tick.ready():
                plots = plot_tick.ready()
                yield (views.chatbot_messages(session, side), views.stats_markdown(side.stats, session.plain_tok_s),
                       views.highlighted(side),
                       views.acceptance_frame(side.stats) if plots else gr.skip(),
                       views.speed_frame(points) if plots else gr.skip())
    except (RequestError, ImageError) as error:
        turn.error = str(error)
        session.turns.append(turn)
    except Exception as error:
        logger.exception("generation failed")
        turn.error = f"generation failed ({type(error).__name__}: {error}); the conversation is kept, try again"
        session.turns.append(turn)
    finally:
        session.pending = None
    stats = side.stats if side else None
    yield (views.chatbot_messages(session), views.stats_markdown(stats, session.plain_tok_s),
           views.highlighted(side) if side else [], views.acceptance_frame(stats), views.speed_frame(points))


def _api_chat(engine: Engine, message_value, session: Session, options: Options):
    """/chat: (answer text, statistics dict), streamed; the turn joins the session's history."""
    tick = views.Throttle(views.UPDATES_PER_SECOND)
    with _user_errors():
        turn = new_turn(message_value, engine, session)
        session.stop.clear()
        for side in answer(engine, session, turn, options):
            if tick.ready():
                yield side.text, views.stats_dict(side.stats)
    yield side.text, views.stats_dict(side.stats)


def _ab_events(engine: Engine, message_value, session: Session, options: Options):
    """run_ab on one message (no chat history), with the session's stop flag."""
    turn = new_turn(message_value, engine)
    session.stop.clear()
    messages = messages_for(Session(), turn, options.system_prompt)
    drafter = options.drafter_for(engine) if engine.drafters else None  # run_ab says why None cannot do
    for event in run_ab(engine, messages, drafter, options.sampling(), options.decode(), session.stop):
        if not isinstance(event, ABProgress) and not event.stopped:
            session.plain_tok_s = event.plain.stats.decode_tok_s
        yield event


def _ab_live(engine: Engine, message_value, session: Session, options: Options):
    tokenizer, tick = engine.target.tokenizer, views.Throttle(views.UPDATES_PER_SECOND)
    with _user_errors():
        for event in _ab_events(engine, message_value, session, options):
            done = not isinstance(event, ABProgress)
            if done or tick.ready():
                verdict = views.ab_markdown(event if done else None, None if done else event.running)
                yield (verdict, event.plain.text, views.highlighted(event.speculative),
                       views.ab_table(event.plain.stats, event.speculative.stats))


def _api_ab(engine: Engine, message_value, session: Session, options: Options):
    """/ab: plain answer, speculative answer, speedup, identical, first difference (or None)."""
    with _user_errors():
        *_, result = _ab_events(engine, message_value, session, options)
    difference = result.as_dict()["first_difference"]
    return result.plain.text, result.speculative.text, result.decode_speedup, result.identical, difference
