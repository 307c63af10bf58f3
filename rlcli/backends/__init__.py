"""Built-in components (registered through the same hooks as third-party plugins)."""

from rlcli import hookimpl
from rlcli.backends.embedded import EmbeddedBackend


@hookimpl
def register_inference_backends() -> list[type]:
    """The built-in inference backends."""
    return [EmbeddedBackend]
