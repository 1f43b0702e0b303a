"""The one exception type for user mistakes; the CLI turns it into one red line and exit code 1."""


class MoetoolError(Exception):
    """A problem the user can fix (bad path, wrong model, corrupt file, impossible budget).

    The message is one sentence that says what is wrong and, where possible, what to do.
    """
