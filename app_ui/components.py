"""The page's parts: the header, the settings sidebar, the Chat and A/B tabs, and the examples
that fit the loaded model; their style and scripts are files in app_ui/page/ (`CSS`, `script`).
The events that connect them are app_ui/layout.py's; the API's message box reads its value as
`ApiMessageData`.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import gradio as gr
from gradio.components.multimodal_textbox import MultimodalData
from gradio.data_classes import FileData
from pydantic import field_validator, model_validator

from app_ui import ab_views, views
from app_ui.served import Served
from engine import settings as schema
from engine.backend import Backend
from engine.images import FORMAT_NAMES, MAX_FILE_BYTES

PAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page")

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
SMOL_EXAMPLES = [  # the SmolLM2 demo: real English text; of the demo's pictures, three it reads right (88.5 % of
    # the world's held-out questions: models/demo/README.md; checked on the third CPU continuation's parts)
    ("Hello! What can you do?", []),
    ("Give me three tips for better sleep.", []),
    ("Write a haiku about autumn leaves.", []),
    ("What colour is the word?", ["card.png"]),
    ("How many shapes are there?", ["scene.png"]),
    ("What does this chart show?", ["chart.png"]),
]
SMOL_NOTE = ("This demo's language model is the real SmolLM2-135M-Instruct, a small model: fluent English, "
             "often wrong on facts. Its vision part was trained here on synthetic pictures of shapes, bar charts "
             "and text cards only, and reads them right about seven times in eight.")
DEMO_NOTE = ("This demo model is tiny (3.6 M parameters, trained here from scratch): it knows only synthetic "
             "pictures of coloured shapes, bar charts and text cards like the examples, and gives confident "
             "nonsense about anything else.")
DEMO_SETTINGS_NOTE = ("The demo model reads every image as the same few tokens and was trained without a system "
                      "prompt, so those two settings are not offered. The app can serve a real VLM in its place "
                      "(see the README).")
SERVER_SETTINGS_NOTE = ("The server decides its own speculative decoding (its drafter and draft length are set where "
                        "it runs), and its own image sizes, so those settings are not offered here.")
AUTO_LABEL = "Auto: the drafter that has been fastest"
WHAT_IS_THIS = ("A small, fast *drafter* guesses the next few tokens (word pieces) and the model "
                "that answers, the *target*, checks all the guesses in one pass, keeping those it would have written "
                "itself: the same answer, sooner. Point at a row to see what it means.")
PICTURE_HINT = ("ℹ️ This demo's vision part knows only its own synthetic pictures (coloured shapes, bar charts, text "
                "cards): about a photo, a screenshot or any other picture, its answer is a guess.")
# The statistics panel's rows (app_ui/views.py) in words a chat user knows, shown when the row is pointed
# at (page/tooltips.js, `TOOLTIPS`); tests/test_browser_chats.py checks that every row has one.
ROW_HELP = {
    "Decode speed": "How fast the answer was written after its first token, in tokens (word pieces) per second.",
    "Time to first token": "How long until the first word appeared: any wait in the queue, reading the pictures "
                           "and the question.",
    "Prompt": "What the model read before answering (your question, the conversation so far and the pictures), in "
              "tokens, and how long reading it took.",
    "Answer": "The answer's length in tokens, counting the end-of-answer token the model writes last, and its time.",
    "Accepted / drafted": "How many tokens the drafter guessed ahead, and how many of them the target kept.",
    "Acceptance": "The share of the drafter's guesses the target kept: the higher, the more time is saved.",
    "Tokens per target pass": "Tokens written per run of the target: 1 without guesses; above 1, guesses saved runs.",
    "Draft shape": "Chain: the drafter guesses one line of tokens. Tree: several alternatives, checked together.",
    "Decoding": "Speculative: a drafter guesses and the target checks. Plain: the target writes every token itself. "
                "At temperature 0 both give the same answer.",
    "Drafter choice": "With Auto: which drafter answered and why (the one that has been fastest so far).",
    "Draft length": "How many tokens the drafter guesses at a time, and why. When guessing costs more than it saves, "
                    "guessing pauses and one token is tried again now and then.",
    "Fell back to plain": "Why this answer was written without guesses.",
    "Status": "Why the answer ended: the model finished, it reached Max new tokens, the time budget, or Stop.",
    "Conversation": "The oldest turns the model no longer reads, so that the conversation fits its memory (context).",
}


def script(name: str) -> str:
    """app_ui/page/NAME.js, a function for an event's `js=`, less its comment lines (Gradio runs
    the text as an expression)."""
    with open(os.path.join(PAGE_DIR, f"{name}.js"), encoding="utf-8") as file:
        return "\n".join(line for line in file.read().splitlines() if not line.lstrip().startswith("//"))


def tooltips() -> str:
    """page/tooltips.js with ROW_HELP in it (an event's `js=` takes no arguments of ours)."""
    return script("tooltips").replace("ROW_HELP", json.dumps(ROW_HELP))


def own_words() -> str:
    """page/own_words.js with the formats the app reads and its upload limit in MB, as the server's
    refusals write them (engine/images.py)."""
    return script("own_words").replace("FORMATS", FORMAT_NAMES).replace("LIMIT_MB", f"{MAX_FILE_BYTES / 1e6:.0f}")


with open(os.path.join(PAGE_DIR, "page.css"), encoding="utf-8") as _file:
    CSS = _file.read()  # launch(css=CSS)
CHAT_HEIGHT = "min(560px, calc(100dvh - 290px))"  # the message box stays on the first screen, phones too


def examples_for(served: Served) -> list[tuple[str, list[str]]]:
    """The examples the loaded model can answer: the demo model's own kind of pictures for it
    (whichever backend serves it), photographs for another model that reads images, text only
    for a backend that reads none (none for the demo model, which knows only its pictures)."""
    if served.smol:
        return SMOL_EXAMPLES
    if not served.reads_images:
        return [] if served.demo else TEXT_EXAMPLES
    return DEMO_EXAMPLES if served.demo else PHOTO_EXAMPLES


def chat_tab(examples: list[dict], demo_model: bool, reads_images: bool = True, note: str | None = None
             ) -> SimpleNamespace:
    """The chat (examples inside it while it is empty: a click sends one), then the live
    statistics (beside it on a wide screen, below it on a phone, in a section that folds); the
    latest answer's highlight and plots appear with the first answer."""
    placeholder = ("Ask about one or more images: drop them here or add them with the clip button below."
                   if reads_images else "Ask a question: this model reads text only, not images.")
    if demo_model or note:
        placeholder += f"\n\n{note or DEMO_NOTE}"
    if examples:
        placeholder += "\n\n**Try an example** (a click sends it):"
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, elem_id="chat-column"):
            chatbot = gr.Chatbot(label="Chat", show_label=False, height=CHAT_HEIGHT, elem_id="chatbot",
                                 buttons=["copy"], placeholder=placeholder,
                                 examples=[{**example, "display_text": example["text"]} for example in examples] or None,
                                 group_consecutive_messages=False, editable="user")
            message = _message_box("chat-input", box_placeholder(demo_model, reads_images, note))
            with gr.Row():  # side by side on a phone too (Gradio wraps buttons under 160 px each)
                stop = gr.Button("Stop", variant="secondary", size="sm", elem_id="chat-stop", interactive=False,
                                 min_width=80)
                new_chat = gr.Button("New chat", size="sm", elem_id="chat-new", min_width=80)
            figures = gr.Markdown(elem_id="chat-figures")  # shown on a phone only (page.css)
            if demo_model or note:  # shown while the chat holds a picture (page.css)
                gr.Markdown(PICTURE_HINT, elem_id="picture-hint")
            with gr.Accordion("What is this?", open=False, elem_id="what-is-this"):  # one line, folded
                gr.Markdown(WHAT_IS_THIS)
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
                           panels=[chatbot, stats, tokens, acceptance_plot, speed_plot, details, figures])


def chat_list() -> SimpleNamespace:
    """The visitor's chats (kept in their browser: app_ui/browser_chats.py), newest first: a click
    opens one; Delete and the two exports act on the chat on screen."""
    with gr.Accordion("Your chats", open=True, elem_id="chats"):
        gr.Markdown("*Kept in this browser only, never on the server.*", elem_id="chats-note")
        choice = gr.Radio([], value=None, label="Chats", show_label=False, elem_id="chat-list", visible=False)
        with gr.Row():
            delete = gr.Button("Delete", size="sm", elem_id="chat-delete", min_width=60)
            markdown = gr.Button("Export .md", size="sm", elem_id="export-md", min_width=60)
            as_json = gr.Button("Export .json", size="sm", elem_id="export-json", min_width=60)
        download = gr.JSON(visible=False)  # the file to save (page/download.js)
    return SimpleNamespace(choice=choice, delete=delete, markdown=markdown, json=as_json, download=download)


def ab_names(served: Served, ab_backend: Backend | None) -> tuple[str, str]:
    """What the A/B tab compares: plain and speculative decoding, or two backends by name."""
    if ab_backend is None:
        return "plain", "speculative"
    return served.name, ab_backend.capabilities.name


def ab_tab(examples: list[dict], served: Served, ab_backend: Backend | None) -> SimpleNamespace:
    """Message box and Stop, the examples (in a section that folds once a run starts, so that the
    results come next), then the verdict over the full width, the two answers (side by side on a
    wide screen, one above the other on a phone) and the table."""
    if ab_backend is None and served.server_decides:
        gr.Markdown(f"*The server at `{served.name}` decides its own decoding, so there is no plain and speculative "
                    "run of it to compare here: start the app with `--ab-backend URL` to compare it with another "
                    "backend (docs/backends.md).*")
    elif ab_backend is None:
        gr.Markdown("One message (no chat history), answered plainly and speculatively with the drafter from the "
                    "settings, in alternating pairs so that a burst of load falls on both alike (the first pair's "
                    "answers are shown; each side's timings count only its own run). At temperature 0 the two "
                    "answers must be identical.")
    else:
        first, second = ab_names(served, ab_backend)
        how = "with the drafter from the settings" if not served.server_decides else "as it decodes"
        gr.Markdown(f"One message (no chat history), answered by **{first}** ({how}) and by **{second}** (as it "
                    "decodes), in alternating pairs; each side's timings count only its own run. At temperature 0, with the same model "
                    "and weights, the two answers should be identical (compared as text when a backend gives no "
                    "token ids).")
    note = SMOL_NOTE if served.smol else None
    message = _message_box("ab-input", box_placeholder(served.demo, served.reads_images, note))  # the chat's words
    with gr.Row():
        stop = gr.Button("Stop", variant="secondary", size="sm", elem_id="ab-stop", interactive=False, scale=0,
                         min_width=160)
    examples_section = None
    if examples:
        with gr.Accordion("Examples (a click puts one in the message box)", open=True,
                          elem_id="ab-examples") as examples_section:  # folded once a run starts
            gr.Examples(examples, inputs=[message], label=None)
    verdict = gr.Markdown(ab_views.ab_markdown(None), elem_id="ab-verdict", container=True)
    with gr.Row(equal_height=False, elem_id="ab-answers"):
        plain = gr.HTML(container=True, min_width=320, elem_id="ab-plain", elem_classes=["tokens"])
        speculative = gr.HTML(container=True, min_width=320, elem_id="ab-speculative", elem_classes=["tokens"])
    table = gr.Markdown(elem_id="ab-table", elem_classes=["stats"])
    return SimpleNamespace(message=message, stop=stop, examples=examples_section,
                           panels=[verdict, plain, speculative, table])


def header(served: Served) -> str:
    title = "## Chat with a vision-language model, faster with speculative decoding\n\n"
    drafters = ", ".join(views.drafter_name(drafter.kind) for drafter in served.drafters.values())
    drafters = "as the server is configured" if served.server_decides else drafters or "none (plain decoding only)"
    images = f"up to {served.max_images} images per conversation"
    if served.engine is None:
        return title + f"Answers from `{served.name}` · speculative decoding: {drafters} · {images}"
    if served.smol:  # its folder is a cache path with a hash: what it is says more
        model = "SmolLM2-135M-Instruct + a vision tower trained on the demo's pictures"
    else:
        model = "/".join(served.model.rstrip("/").rsplit("/", 2)[-2:])
    return title + f"Model `{model}` ({served.family}) · drafters: {drafters} · {images}"


def settings_controls(served: Served) -> dict:
    """The request settings, keyed by Options' field names (the API's parameter names too).
    Settings that change nothing for the loaded model (or that the backend cannot honour: another
    backend's draft settings) are hidden, and a note says why. (layout.py turns the drafter
    controls off in plain mode.)"""
    choices = [(views.drafter_name(drafter.kind) + (" (default)" if key == served.default_drafter else ""), key)
               for key, drafter in served.drafters.items()] or [("none", "none")]
    if len(served.drafters) > 1:  # engine/auto.py: per request, the drafter that has delivered the most
        auto = ("Auto" + (" (default)" if served.auto else ""), "auto")
        choices = [auto] + choices if served.auto else choices + [auto]
    speculative = bool(served.drafters)
    demo_model, image_tokens = served.demo, served.image_budget
    settings = {
        "mode": _control("mode", gr.Radio, value="speculative" if speculative else "plain", info=None),
        "drafter": _control("drafter", gr.Dropdown, choices=choices, value=choices[0][1], interactive=speculative,
                            info=drafter_info(served, choices[0][1]), elem_id="drafter"),
        "draft_tokens": _control("draft_tokens", gr.Slider, interactive=speculative),
        "adaptive": _control("adaptive", gr.Checkbox, info=None, interactive=speculative),
        "temperature": _control("temperature", gr.Slider),
        "top_p": _control("top_p", gr.Slider),
        "max_new_tokens": _control("max_new_tokens", gr.Slider),
        "seed": _control("seed", gr.Number, precision=0, info=schema.spec("seed").help + "; Retry takes the next"),
        "system_prompt": _control("system_prompt", gr.Textbox, info=None, lines=2, visible=not demo_model),
        "max_image_tokens": _control("max_image_tokens", gr.Slider, maximum=image_tokens or 4096, step=16,
                                     value=min(served.max_image_tokens or 0, image_tokens or 0),
                                     info="0: the model's own limit", visible=image_tokens is not None),
        "draft_tree": _control("draft_tree", gr.Slider, interactive=speculative),
        "top_k": _control("top_k", gr.Slider),
        "tree_branching": _control("tree_branching", gr.Slider, interactive=speculative),
    }
    assert list(settings) == schema.names(), "a control per setting, in the schema's order (the API's)"
    if demo_model:
        gr.Markdown(f"*{DEMO_SETTINGS_NOTE}*", elem_id="settings-note")
    _hide_what_the_backend_decides(served, settings)
    return settings


DRAFTER_CONTROLS = ("drafter", "draft_tokens", "adaptive", "draft_tree", "tree_branching")  # off in plain mode


def drafter_info(served: Served, key: str) -> str:
    """The line under the Drafter menu for the drafter `key` (or "auto")."""
    drafter = served.drafters.get(key)
    label = AUTO_LABEL if key == "auto" else views.DRAFTER_LABELS.get(drafter.kind, drafter.kind) if drafter else ""
    return label.partition(": ")[2]


def _control(name: str, kind: type, **overrides):
    """The setting's control of Gradio class `kind` from the schema's `control(name)` (engine/settings.py):
    its label, help, default, and choices (a Radio, a Dropdown) or (least, most, step) (a Slider; a Number
    takes any whole number, `check` refuses one out of range); `overrides` for what the loaded model decides
    (the drafters, the image budget) and where the sidebar words it otherwise."""
    shown = schema.control(name)
    options = {"label": shown["label"], "info": shown["info"], "value": shown["value"]}
    if shown["choices"] and kind in (gr.Radio, gr.Dropdown):
        options["choices"] = list(shown["choices"])
    if shown["range"] and kind is gr.Slider:
        options["minimum"], options["maximum"], options["step"] = shown["range"]
    return kind(**(options | overrides))


def _hide_what_the_backend_decides(served: Served, settings: dict) -> None:
    """Another backend has no built-in draft settings; a server with no drafters to choose decides
    its own decoding, so it gets no mode or drafter either, and a note says so."""
    hidden = () if served.engine is not None else ("draft_tokens", "adaptive", "draft_tree", "tree_branching", "top_k")
    if served.server_decides:
        hidden += ("mode", "drafter")
        gr.Markdown(f"*{SERVER_SETTINGS_NOTE}*", elem_id="settings-note")
    for name in hidden:
        settings[name].visible = False  # before the page is built: Gradio reads it when it launches


def _message_box(elem_id: str, placeholder: str) -> gr.MultimodalTextbox:
    return gr.MultimodalTextbox(file_types=["image"], file_count="multiple", show_label=False, elem_id=elem_id,
                                placeholder=placeholder)


def box_placeholder(demo_model: bool, reads_images: bool, note: str | None) -> str:
    """The chat box's words: text questions too, except for the 3.6 M demo, which knows only pictures."""
    if not reads_images:
        return "Ask a question… (this model reads text only)"
    if demo_model and not note:
        return "Ask about the images… (drop, paste or upload several)"
    return "Ask anything, or about images… (drop, paste or upload several)"


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
