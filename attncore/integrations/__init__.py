"""Optional integrations with other libraries.

Each submodule is imported only on request (``import
attncore.integrations.transformers``); importing attncore imports none of
them, nor the libraries they integrate with.
"""
