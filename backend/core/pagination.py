"""Pagination of list endpoints: `offset` and `limit` query parameters, `X-Total-Count` header."""

from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Query, Response

T = TypeVar("T")
TOTAL_HEADER = "X-Total-Count"


@dataclass(frozen=True)
class PageParams:
    """Which slice of a list to return: items `offset` .. `offset + limit - 1`."""

    offset: int
    limit: int


def page_params(
    offset: Annotated[int, Query(ge=0, description="items to skip")] = 0,
    limit: Annotated[int, Query(ge=1, le=500, description="most items to return")] = 100,
) -> PageParams:
    return PageParams(offset=offset, limit=limit)


Page = Annotated[PageParams, Depends(page_params)]


def paginated(items: list[T], page: PageParams, response: Response) -> list[T]:
    """The page's slice of a short list held in memory; the full length goes in X-Total-Count."""
    response.headers[TOTAL_HEADER] = str(len(items))
    return items[page.offset : page.offset + page.limit]
