"""A small HTML tree over the standard library's parser, for asserting on rendered pages."""

from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "track",
    "wbr",
}


@dataclass
class Node:
    """An element: its tag, attributes, parent and children (text nodes are plain strings)."""

    tag: str
    attrs: dict[str, str]
    parent: "Node | None" = None
    children: list["Node | str"] = field(default_factory=list)

    def iter(self) -> "list[Node]":
        """This element and every element below it, in document order."""
        found = [self]
        for child in self.children:
            if isinstance(child, Node):
                found.extend(child.iter())
        return found

    def find_all(self, tag: str | None = None, **attrs: str) -> "list[Node]":
        """Elements with `tag` (any if None) whose attributes include `attrs` (`class_` = class)."""
        wanted = {k.rstrip("_").replace("_", "-"): v for k, v in attrs.items()}
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag) and all(n.attrs.get(k) == v for k, v in wanted.items())
        ]

    def find(self, tag: str | None = None, **attrs: str) -> "Node":
        """The first match of `find_all`; fails the test when there is none."""
        matches = self.find_all(tag, **attrs)
        assert matches, f"no <{tag or '*'}> with {attrs}"
        return matches[0]

    def by_id(self, element_id: str) -> "Node":
        return self.find(id=element_id)

    def text(self) -> str:
        """The text inside, whitespace collapsed."""
        parts = [c if isinstance(c, str) else c.text() for c in self.children]
        return " ".join(" ".join(parts).split())


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.current = self.root

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs}, parent=self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_endtag(self, tag: str) -> None:
        node: Node | None = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.current = node.parent

    def handle_data(self, data: str) -> None:
        self.current.children.append(data)


def parse(html: str) -> Node:
    """The document tree of `html`."""
    builder = _TreeBuilder()
    builder.feed(html)
    return builder.root
