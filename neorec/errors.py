"""One error type for every user-facing failure: bad configs, bad data, impossible plans."""


class NeorecError(Exception):
    """A mistake the user can fix. The message names the file/line, key, table or feature concerned."""


class ConfigError(NeorecError):
    """A config value is unknown, of the wrong type, or impossible. The message names the key."""


class DataError(NeorecError):
    """Input data is malformed. The message names the file and line, or the feature."""


class DistributedError(NeorecError):
    """Another rank failed or stopped answering; the message names it and how long this rank waited."""
