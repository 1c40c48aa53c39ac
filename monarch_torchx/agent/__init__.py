"""The host agent (``python -m monarch_torchx.agent``) and its process launcher."""
