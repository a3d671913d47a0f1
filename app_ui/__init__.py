"""The Gradio app's parts: configuration and engine setup (setup), a visitor's conversation
(session), what the panels show (views) and the Blocks wiring (layout). `app.py` joins them."""
