"""`onegpu serve`: an OpenAI-compatible HTTP server on the decode engine.

app.py (routes: OpenAI schemas in, engine requests out), schemas.py (request bodies and errors),
responses.py (answers and stream chunks), scheduler.py (the engine-loop thread, admission,
cancellation), adapters.py (LoRA adapters by name), metrics.py
(Prometheus), server.py (uvicorn and the SIGTERM drain), launch.py (settings to a running server).
"""
