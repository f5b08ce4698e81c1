"""The served OpenAPI document: every operation documented with the one error shape,
request bodies with examples, lists paginated, the API token security scheme."""

from fastapi.testclient import TestClient

ERROR = "#/components/schemas/ErrorResponse"


def _operations(doc: dict) -> list[tuple[str, str, dict]]:
    return [
        (method, path, op)
        for path, ops in doc["paths"].items()
        if path.startswith("/api/v1/")
        for method, op in ops.items()
    ]


def _has_examples(doc: dict, ref: str) -> bool:
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return "examples" in schema or any("examples" in p for p in schema["properties"].values())


def test_every_error_answer_has_the_shared_shape(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    for method, path, op in _operations(doc):
        errors = {code: r for code, r in op["responses"].items() if code.startswith("4")}
        assert errors or path == "/api/v1/health", (method, path)
        for code, response in errors.items():
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": ERROR}, (method, path, code)


def test_request_bodies_have_examples(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    for method, path, op in _operations(doc):
        for content in op.get("requestBody", {}).get("content", {}).values():
            assert _has_examples(doc, content["schema"]["$ref"]), (method, path)


def test_lists_take_offset_and_limit(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    for method, path, op in _operations(doc):
        answer = op["responses"].get("200", {}).get("content", {}).get("application/json", {})
        if method == "get" and answer.get("schema", {}).get("type") == "array":
            names = {p["name"] for p in op.get("parameters", [])}
            assert {"offset", "limit"} <= names or "after_id" in names, path


def test_security_scheme_and_pagination_header(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["APIToken"]["scheme"] == "bearer"
    for index in range(3):
        client.post("/api/v1/projects", json={"name": f"p{index}"})
    page = client.get("/api/v1/projects", params={"offset": 1, "limit": 1})
    assert page.headers["x-total-count"] == "3" and len(page.json()) == 1
