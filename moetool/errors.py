"""The one exception type for user mistakes; the CLI turns it into one red line and exit code 1."""


class MoetoolError(Exception):
    """A problem the user can fix (bad path, wrong model, corrupt file, impossible budget).

    The message is one sentence that says what is wrong and, where possible, what to do.
    """


def yaml_error(what: str, e: Exception) -> MoetoolError:
    """One sentence for a YAML file that does not parse: `what` ("task file X"), the line, the problem."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    return MoetoolError(f"{what} is not valid YAML{where}: {getattr(e, 'problem', None) or e}.")
