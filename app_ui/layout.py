"""The Gradio Blocks: the page's parts (app_ui/components.py), then the events that connect them
to the callbacks (app_ui/callbacks.py). The callbacks get what the app serves explicitly (they
close over the `served` argument of `build_demo`); sessions live in one gr.State per visitor.

API (README, API): /chat, /ab, /stop, /clear. Every callback tells `Visitors` that its session
is live; a cleared conversation's uploads are deleted (app_ui/visitors.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import gradio as gr

from app_ui import browser_chats, callbacks, components, views
from app_ui.callbacks import GENERATE
from app_ui.components import EXAMPLES_DIR
from app_ui.served import Served, served_of
from app_ui.session import Options, Session, Turn, checked, read_message
from app_ui.visitors import Visitors
from engine import settings as schema
from engine.backend import Backend
from engine.engine import Engine, RequestError

INSTANT = {"concurrency_limit": None, "api_visibility": "private", "show_progress": "hidden"}  # quick, not limited
# Not limited here either: the image jail bounds the decodes, all together and per address (engine/image_jail.py).
PREPARE = {"concurrency_limit": None, "api_visibility": "private", "show_progress": "minimal"}
ON_LOAD, FOCUS_INPUT, DROP_ON_CHAT, KEYBOARD, DROP_REFUSED_FILES, DOWNLOAD = (components.script(name) for name in (
    "on_load", "focus_input", "drop_on_chat", "keyboard", "drop_refused_files", "download"))


def build_demo(served: Served | Engine, gpu: Callable = lambda fn: fn, visitors: Visitors | None = None,
               ab_backend: Backend | None = None) -> gr.Blocks:
    """The app for `served` (what app_ui/served.py describes: the built-in engine or another
    backend; a loaded Engine is described here). `ab_backend`: the A/B tab compares `served`
    with it instead of plain with speculative decoding. `gpu` wraps every callback that generates
    (spaces.GPU on ZeroGPU). Launch it with `css=components.CSS`, and with `visitors`' Guard and
    lifespan (see app.py)."""
    served, visitors = served_of(served), visitors or Visitors()
    if not gr.utils.is_static_file(os.path.join(EXAMPLES_DIR, "chart.png")):  # once a process
        gr.set_static_paths([EXAMPLES_DIR])  # served from their own folder, never copied among the uploads
    examples = [{"text": text, "files": [os.path.join(EXAMPLES_DIR, f) for f in files]}
                for text, files in components.examples_for(served)]
    # Gradio's own backstop: its files older than a day are deleted, checked hourly (Visitors deletes
    # unsent uploads after minutes, and a conversation's uploads when it is cleared or expires).
    with gr.Blocks(title="VLM chat · speculative decoding", fill_width=True, delete_cache=(3600, 86400)) as demo:
        session = gr.State(Session())  # copied for every visitor: a new, empty session each
        gr.Markdown(components.header(served), elem_id="header")
        with gr.Sidebar(label="Chats and settings", open=True, width=300):
            chats = components.chat_list()
            gr.Markdown("### Settings")
            settings = components.settings_controls(served)  # {Options field: its control}
        demo.load(None, js=ON_LOAD)
        demo.load(None, js=DROP_ON_CHAT)
        demo.load(None, js=KEYBOARD)
        demo.load(None, js=components.tooltips())
        demo.load(None, js=components.own_words())
        with gr.Tab("Chat"):
            chat = components.chat_tab(examples, served.demo, served.reads_images,
                                       components.SMOL_NOTE if served.smol else None)
        with gr.Tab(f"A/B: {' vs '.join(components.ab_names(served, ab_backend))}"):
            ab = components.ab_tab(examples, served, ab_backend)
        _wire_settings(served, settings)
        for box in (chat.message, ab.message):
            _flag_refused_files(served, box, visitors)
        kept = _wire_kept(demo, served, session, settings, chat, chats, visitors)
        _wire_chat(served, gpu, session, settings, chat, visitors, examples, kept)
        _wire_ab(served, gpu, session, {k: v for k, v in settings.items() if k != "mode"}, ab, visitors, ab_backend)
        _wire_api(served, gpu, session, settings, visitors, ab_backend)
    return demo


def _wire_settings(served: Served, settings: dict) -> None:
    """The drafter controls are off in plain mode; the line under the Drafter menu describes the one chosen."""
    speculative = bool(served.drafters)
    settings["mode"].change(lambda mode: [gr.update(interactive=mode == "speculative" and speculative)]
                            * len(components.DRAFTER_CONTROLS), [settings["mode"]],
                            [settings[name] for name in components.DRAFTER_CONTROLS], **INSTANT)
    settings["drafter"].change(lambda key: gr.update(info=components.drafter_info(served, key)),
                               [settings["drafter"]], [settings["drafter"]], **INSTANT)


def _flag_refused_files(served: Served, box: gr.MultimodalTextbox, visitors: Visitors) -> None:
    """A file that is not a usable image is named in a notice as soon as it is attached, and taken
    out of the box; the text stays, typed meanwhile too (the box is edited on the page:
    DROP_REFUSED_FILES). Each upload is decoded once (callbacks.refused_files), and kept for the send
    in the upload ledger (`visitors`)."""
    refused = gr.JSON(visible=False)
    checked: dict[str, str | None] = {}

    def check(message, request: gr.Request):
        return callbacks.refused_files(served, message, checked, client=callbacks.client_of(request),
                                       ledger=visitors)

    box.change(check, [box], [refused], **INSTANT, trigger_mode="always_last")
    refused.change(None, [refused, box], [box], js=DROP_REFUSED_FILES, **INSTANT)


def _wire_kept(demo: gr.Blocks, served: Served, session: gr.State, settings: dict, chat: SimpleNamespace,
               chats: SimpleNamespace, visitors: Visitors) -> SimpleNamespace:
    """The chats and settings kept in the visitor's browser (app_ui/browser_chats.py): on load the
    chat on screen comes back with its statistics, and the settings; a click in the list opens a
    chat, Delete deletes the one on screen, the exports save it as a file; clicking an answer shows
    its statistics. Returns the events that keep the chat after a change (`save`) and start a new
    one in the list (`fresh`)."""
    kept = gr.BrowserState(browser_chats.EMPTY, storage_key=browser_chats.CHATS_KEY, secret=browser_chats.SECRET)
    kept_settings = gr.BrowserState({}, storage_key=browser_chats.SETTINGS_KEY, secret=browser_chats.SECRET)
    drafters = {key: drafter.kind for key, drafter in served.drafters.items()}
    screen, figures, statistics = [chat.message, *chat.panels], chat.panels[-1], chat.panels[1]

    def shown(session: Session) -> tuple:  # the box emptied, the panels of the chat on screen
        table, line = browser_chats.latest_statistics(session)
        return None, *callbacks.panels(views.chatbot_messages(session), statistics=table)[:-1], line

    def listed(value: dict):
        listed_chats = browser_chats.choices(value)
        return gr.Radio(choices=listed_chats, value=value["current"], visible=bool(listed_chats))

    def check(name, value):
        checked(Options(**{name: value}), served)

    def restore(session: Session, value, stored_settings, request: gr.Request):
        value = browser_chats.chats_of(value)
        if session.is_new():  # a reload; not a second load of a page that is talking already
            browser_chats.restore(session, value)
            visitors.touch(session, request.session_hash)
        usable = browser_chats.usable_settings(stored_settings, list(settings), check)
        panels = shown(session)[1:] if session.turns else [gr.skip()] * len(chat.panels)  # an empty chat: as drawn
        return *panels, listed(value) if value["chats"] else gr.skip(), *(gr.update(value=usable[name]) if name in usable else gr.skip()
                                                 for name in settings)

    def switch(session: Session, chosen, value):
        callbacks.clear(session, visitors)
        value = browser_chats.chats_of(value)
        value["current"] = chosen if any(c["id"] == chosen for c in value["chats"]) else None
        browser_chats.restore(session, value)
        return *shown(session), value

    def delete(session: Session, value):
        callbacks.clear(session, visitors)
        value = browser_chats.without_current(value)
        return *shown(session), value, listed(value)

    def save(session: Session, value):
        value = browser_chats.with_chat(value, [browser_chats.kept_turn(turn, drafters) for turn in session.turns])
        return value, listed(value)

    def fresh(value):
        value = {**browser_chats.chats_of(value), "current": None}
        return value, listed(value)

    def selected(session: Session, event: gr.SelectData):
        return browser_chats.answer_statistics(session, event.index, drafters)

    demo.load(restore, [session, kept, kept_settings], [*chat.panels, chats.choice, *settings.values()], **INSTANT)
    chats.choice.input(switch, [session, chats.choice, kept], [*screen, kept], **INSTANT)
    chats.delete.click(delete, [session, kept], [*screen, kept, chats.choice], **INSTANT)
    for button, kind in ((chats.markdown, "md"), (chats.json, "json")):
        button.click(lambda value, kind=kind: browser_chats.export(value, kind), [kept], [chats.download],
                     **INSTANT).then(None, [chats.download], None, js=DOWNLOAD)
    chat.chatbot.select(selected, [session], [statistics, figures], **INSTANT)
    gr.on([control.change for control in settings.values()], lambda *values: dict(zip(settings, values)),
          list(settings.values()), [kept_settings], **INSTANT)
    return SimpleNamespace(save=dict(fn=save, inputs=[session, kept], outputs=[kept, chats.choice], **INSTANT),
                           fresh=dict(fn=fresh, inputs=[kept], outputs=[kept, chats.choice], **INSTANT))


def _wire_chat(served: Served, gpu: Callable, session: gr.State, settings: dict, chat: SimpleNamespace,
               visitors: Visitors, examples: list[dict], kept: SimpleNamespace) -> None:
    """Send (or click an example): check the message without opening its files (or refuse it,
    saying why, with the message left in the box), show it in the chat at once with Stop on,
    then prepare its images and answer it in the queue. The box stays open while an answer
    streams, and has the focus again when it ends."""
    demo_model = served.demo

    def accept(message_value, session: Session, request: gr.Request):  # no outputs: a refusal is a toast
        visitors.touch(session, request.session_hash)
        if callbacks.is_empty(message_value):  # Enter in an empty box: nothing happens, no toast
            raise gr.Error("the message is empty", visible=False, print_exception=False)
        with callbacks.user_errors():
            if session.pending is not None or session.running:
                raise RequestError("an answer is still streaming: wait for it, or press Stop (your message "
                                   "stays in the box)")
            session.check_not_expired(visitors.limits.idle_s)
            text, files = read_message(message_value, served, session)
            callbacks.check_queue(request, visitors)  # the answer would be refused in the queue: say so now
            callbacks.claim(visitors, session, files, request)
            visitors.spoke(session, request.session_hash)
            callbacks.start(session, Turn(text, files, [], arrived=callbacks.arrival(request)))

    def accept_example(event: gr.SelectData, session: Session, request: gr.Request):
        if not (isinstance(event.index, int) and 0 <= event.index < len(examples)):  # a script's index
            raise gr.Error(f"there is no example {str(event.index)[:20]}: the page shows {len(examples)}",
                           print_exception=False)
        accept(examples[event.index], session, request)  # our own list: the click names only its place

    def show(session: Session, clear_box: bool = True):
        return (gr.MultimodalTextbox(value=None) if clear_box else gr.skip(), views.chatbot_messages(session),
                gr.Button(variant="stop", interactive=True), *callbacks.shown_waiting(session))

    def new_conversation(session: Session):
        callbacks.clear(session, visitors)
        return None, *callbacks.panels([])

    def edit(event: gr.EditData, session: Session, request: gr.Request):
        visitors.touch(session, request.session_hash)
        with callbacks.user_errors():
            edit_turn(served, session, visitors, event.index, event.value, request)

    @gpu
    def respond(session: Session, *values):
        visitors.touch(session)
        yield from callbacks.respond(served, session, dict(zip(settings, values)), demo_model, visitors)

    # preprocess=False: the settings reach callbacks.respond as sent, which checks them and clears the
    # turn when one is wrong (Gradio's own check would refuse before the callback, leaving the turn pending).
    respond_event = dict(fn=respond, inputs=[session, *settings.values()], outputs=[*chat.panels, chat.message],
                         show_progress_on=[chat.chatbot], show_progress="minimal", api_visibility="private",
                         preprocess=False, **GENERATE)
    idle = dict(fn=lambda: gr.Button(variant="secondary", interactive=False), outputs=[chat.stop],
                js=FOCUS_INPUT, **INSTANT)
    focus = dict(fn=None, js=FOCUS_INPUT, **INSTANT)  # again once the chat is kept (the chat list redrawn)
    figures, statistics = chat.panels[-1], chat.panels[1]
    waiting = [statistics, chat.panels[2], chat.panels[5], figures, _line_timer(served, session, chat)]
    shown = [chat.message, chat.chatbot, chat.stop, *waiting]  # waiting: callbacks.shown_waiting's
    prepare = _prepare_event(served, session, chat.chatbot, visitors)

    def answered(accepted, clear_box: bool = True):  # a turn accepted: shown, its images prepared, answered, kept
        accepted.success(lambda session: show(session, clear_box), [session], shown, **INSTANT).success(**prepare) \
            .success(**respond_event).then(**idle).then(**kept.save).then(**focus)

    answered(chat.message.submit(accept, [chat.message, session], None, **INSTANT))
    answered(chat.chatbot.example_select(accept_example, [session], None, **INSTANT), clear_box=False)
    edited = chat.chatbot.edit(edit, [session], None, **INSTANT)  # the box keeps what is being typed there
    answered(edited, clear_box=False)
    edited.failure(views.chatbot_messages, [session], [chat.chatbot], **INSTANT)  # refused: the chat as it was
    chat.chatbot.retry(_retry(visitors), [session, settings["temperature"], settings["seed"]],
                       [chat.chatbot, settings["seed"], chat.stop, *waiting], **INSTANT) \
        .success(**respond_event).then(**idle).then(**kept.save).then(**focus)
    chat.chatbot.undo(undo, [session], [chat.message, *chat.panels], **INSTANT).then(**kept.save)
    chat.new_chat.click(new_conversation, [session], [chat.message, *chat.panels], **INSTANT).then(**kept.fresh)
    chat.chatbot.clear(new_conversation, [session], [chat.message, *chat.panels], **INSTANT).then(**kept.fresh)
    chat.stop.click(callbacks.stopper(visitors), [session], None, queue=False, api_name="stop")


def _retry(visitors: Visitors):
    def retry(session: Session, temperature, seed, request: gr.Request):
        """The last turn again; with sampling, from the next seed (the same seed gives the same answer;
        after 2**63 - 1 comes 0; a seed that is not one is left for the answer to name)."""
        visitors.touch(session, request.session_hash)
        if session.pending is None and session.turns:
            if callbacks.number(temperature) > 0:
                seed = callbacks.next_seed(seed)
            last = session.turns.pop()
            callbacks.start(session, Turn(last.text, last.files, last.images, pictures=last.pictures))
        # The panel says the new answer is on its way: the last one's figures would read as this one's.
        waiting = callbacks.shown_waiting(session) if session.pending is not None else [gr.skip()] * 5
        return views.chatbot_messages(session), seed, gr.Button(variant="stop", interactive=True), *waiting
    return retry


def edit_turn(served: Served, session: Session, visitors: Visitors, index, value, request: gr.Request | None
              ) -> None:
    """The chat's edit of an earlier question (`index`: its chat message, Gradio's EditData.index;
    `value`: the new words): it and the turns after it make way for the edited question, its
    pictures kept, which is then answered like a new message (Session.edit). RequestError while an
    answer is on its way, for an index that names no question, an empty or over-long text."""
    number = index[0] if isinstance(index, (list, tuple)) and index else index
    if session.pending is not None or session.running:
        raise RequestError("an answer is still streaming: wait for it, or press Stop, then edit")
    if not isinstance(number, int) or number % 2 or not 0 <= number // 2 < len(session.turns):
        raise RequestError(f"there is no question {str(index)[:20]} in this chat to edit")
    session.check_not_expired(visitors.limits.idle_s)
    turn = session.turns[number // 2]
    text, _ = read_message({"text": _edited_text(value), "files": turn.files}, served)
    callbacks.check_queue(request, visitors)
    visitors.release(session, session.edit(number // 2, text))
    session.pending.arrived = callbacks.arrival(request)


def _edited_text(value) -> str:
    """The words of an edited message as the chat sends them (a string; a message's parts, of which the text)."""
    if isinstance(value, dict):
        value = value.get("text", value.get("content", ""))
    if isinstance(value, (list, tuple)):
        value = " ".join(part for part in value if isinstance(part, str))
    if not isinstance(value, str):
        raise RequestError(f"an edited message must be text, not {type(value).__name__}")
    return value


def undo(session: Session):
    """The last turn taken back: its message in the box again (nothing while an answer is on its way)."""
    message = session.turns.pop().message if session.pending is None and session.turns else gr.skip()
    return message, *callbacks.panels(views.chatbot_messages(session))


def _line_timer(served: Served, session: gr.State, chat: SimpleNamespace) -> gr.Timer:
    """While a sent turn waits in line, its place and the wait expected, each second in the panel
    and the key figures (callbacks.line_panel); started by callbacks.shown_waiting, it stops itself."""
    line = gr.Timer(1.0, active=False)

    def in_line(session: Session, request: gr.Request):
        return callbacks.line_panel(served, session, request)

    line.tick(in_line, [session], [chat.panels[1], chat.panels[-1], line], **INSTANT)
    return line


def _prepare_event(served: Served, session: gr.State, chatbot: gr.Chatbot, visitors: Visitors) -> dict:
    """The step between showing a message and answering it: its images decoded in the jail (or as the
    check when they were attached left them in the ledger), outside the answer slot
    (callbacks.prepare); the chat shows Gradio's pending dots meanwhile, as it does while the
    answer's step waits."""
    def prepare_images(session: Session, request: gr.Request):
        callbacks.prepare(served, session, request, visitors)

    return dict(fn=prepare_images, inputs=[session], outputs=None, show_progress_on=[chatbot], **PREPARE)


def _wire_ab(served: Served, gpu: Callable, session: gr.State, settings: list, ab: SimpleNamespace,
             visitors: Visitors, ab_backend: Backend | None) -> None:
    """`settings` without the mode."""

    @gpu
    def ab_live(request: gr.Request, message_value, session: Session, *values):  # Gradio puts the request first
        visitors.touch(session, request.session_hash)
        options = Options(mode="speculative", **dict(zip(settings, values)))
        yield from callbacks.ab_live(served, message_value, session, options, callbacks.arrival(request), ab_backend,
                                     request, visitors)

    def start_run(message_value):  # Enter in an empty box: nothing happens, no toast (as in the chat)
        if callbacks.is_empty(message_value):
            raise gr.Error("the message is empty", visible=False, print_exception=False)
        stop = gr.Button(variant="stop", interactive=True)
        return (stop, gr.Accordion(open=False)) if ab.examples else stop

    running = dict(fn=start_run, inputs=[ab.message], outputs=[ab.stop, ab.examples] if ab.examples else [ab.stop],
                   **INSTANT)
    idle = dict(fn=lambda: gr.Button(variant="secondary", interactive=False), outputs=[ab.stop], **INSTANT)
    # Like the chat's: once the run has taken the message, the box empties (the verdict shows what was
    # asked), so the next run's inputs are what the box then shows, never copies added to the last ones.
    # A refused message stays in the box.
    live = ab.message.submit(**running).success(ab_live, [ab.message, session, *settings.values()], ab.panels,
                                             show_progress_on=ab.panels[:1], api_visibility="private", **GENERATE)
    live.then(**idle)
    live.success(lambda: gr.MultimodalTextbox(value=None), None, [ab.message], **INSTANT)
    ab.stop.click(callbacks.stopper(visitors), [session], None, queue=False, api_visibility="private")


def _wire_api(served: Served, gpu: Callable, session: gr.State, settings: list, visitors: Visitors,
              ab_backend: Backend | None) -> None:
    """The API-only endpoints /chat, /ab and /clear (/stop is the Stop button's); the
    settings schema names their parameters (engine/settings.py). Their inputs and outputs are hidden
    components. The message box takes any file type: Gradio's own type check would refuse a
    non-image file without naming it, our image validation names the file and the reason."""
    with gr.Row(visible=False):
        message = gr.MultimodalTextbox(file_count="multiple", label="message")
        message.data_model = components.ApiMessageData  # so that new_turn names a missing text or null files
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
        yield from callbacks.api_chat(served, message, session, Options(**values), callbacks.arrival(request),
                                      visitors, request.session_hash, request)

    @gpu
    def ab(message, session, request: gr.Request, **values):
        """Answer one message (no history) plainly and speculatively: both answers, the decode speedup,
        whether they are identical and where they first differ (None when identical; both None when
        stopped)."""
        visitors.touch(session, request.session_hash)
        return callbacks.api_ab(served, message, session, Options(mode="speculative", **values),
                                callbacks.arrival(request), ab_backend, request, visitors)

    def clear(session):
        callbacks.clear(session, visitors)

    # preprocess=False: the values reach Options.checked as sent (a slider would refuse a value out of
    # its range without naming the parameter); the message's files are still checked by Gradio.
    trigger.click(chat, [message, session], [answer_text, statistics], api_name="chat", preprocess=False,
                  inputs_kwargs={name: settings[name] for name in schema.api_names()}, **GENERATE)
    trigger.click(ab, [message, session], [plain, speculative, speedup, identical, first_difference], api_name="ab",
                  inputs_kwargs={name: settings[name] for name in schema.api_names(mode=False)}, preprocess=False,
                  **GENERATE)
    trigger.click(clear, [session], None, api_name="clear", concurrency_limit=None)
