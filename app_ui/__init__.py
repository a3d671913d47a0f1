"""The Gradio app's parts: configuration and engine setup (setup), a visitor's conversation
(session), what the panels show (views), the page's components (components, with their style and
scripts in page/), the callbacks (callbacks) and the Blocks wiring (layout). `app.py` joins them."""
