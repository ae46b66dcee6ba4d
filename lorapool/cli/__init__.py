"""The ``lorapool`` command line: one module per command group, imported when invoked.

May import: click, rich and any part of lorapool, but only inside the command that
needs it, so that producer-side commands run on an install without torch.
"""
