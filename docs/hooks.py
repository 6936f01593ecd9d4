"""mkdocs hooks (mkdocs.yml ``hooks:``): the generated pages and the links that leave docs/.

The pages themselves come from ``tileproof.oracle.docs_site``; this file only hands them to mkdocs,
in memory, so that nothing generated is ever written into docs/.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

from tileproof.oracle import docs_site


def on_files(files, config):
    for path, markdown in docs_site.generated_pages(Path(config["docs_dir"])).items():
        if files.get_file_from_path(path) is not None:
            # A committed page of that name would be silently shadowed by the generated one.
            raise PluginError(f"docs/{path} is generated when the site is built: remove the committed file")
        files.append(File.generated(config, path, content=markdown))
    return files


def on_page_markdown(markdown, page, config, files):
    pages = {file.src_uri for file in files.documentation_pages()}
    markdown = docs_site.rewrite_links_for_site(markdown, page.file.src_uri, pages)
    return docs_site.markdown_inside_details(markdown)
