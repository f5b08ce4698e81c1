# One image for the API and the agents; the command chooses the role.
FROM python:3.11-slim
# Agents run each rank under bubblewrap as polytrain-run (docs/security.md).
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --user-group --no-create-home --shell /usr/sbin/nologin polytrain-run
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY backend backend
COPY worker worker
COPY frontend frontend
COPY migrations migrations
COPY examples examples
# For a CPU-only image pass your CPU wheel index: --build-arg TORCH_PIP_ARGS="--index-url URL"
ARG TORCH_PIP_ARGS=""
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_PIP_ARGS} && pip install --no-cache-dir .
ENV POLYTRAIN_DATA_DIR=/data
EXPOSE 8000
CMD ["polytrain", "api", "--host", "0.0.0.0", "--port", "8000"]
