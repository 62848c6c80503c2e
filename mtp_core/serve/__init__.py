"""The OpenAI-compatible HTTP server (`mtp serve`): one engine loop thread, FastAPI + uvicorn in front."""
