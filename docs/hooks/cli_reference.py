"""MkDocs hook: the CLI reference page's marker becomes every command's --help, made from the
parsers themselves (kvatlas.cli.reference), so the page cannot drift from the code."""

from kvatlas.cli import reference


def on_page_markdown(markdown, page, **kwargs):
    if reference.MARKER in markdown:
        return markdown.replace(reference.MARKER, reference.markdown())
    return markdown
