"""Requests from outside the process: validation, the scheduler thread that owns the batch, Triton (launcher,
supervisor, model glue helpers), the OpenAI endpoint and the clients.

Imports `decoding` (and through it `engines`); nothing below imports this room.
"""
