"""Attention backends, one file each: what it supports (`Backend.not_supported_reasons`) and the call.

`base` defines the interface; `longctx.dispatch` imports the backends and owns the auto order. To add a backend, write
one file here with a `Backend` subclass and add it to `longctx.dispatch`'s list.
"""
