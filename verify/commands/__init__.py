"""``python -m verify`` commands and what only they use (the HTML page, the mutation harness).

Loads nothing: the pytest plugin imports ``verify.commands.html.browser`` and the CLI parser
``verify.commands.mutation.lines`` without torch.
"""
