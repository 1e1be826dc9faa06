"""The one exception type raised for every bad topology input."""


class TopologyError(ValueError):
    """A topology, schedule or graph was asked for with invalid arguments.

    The message names the bad value and says what is allowed.
    """
