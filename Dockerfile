# One image for the API and the agents; the command chooses the role.
FROM python:3.11-slim
# The API runs as the unprivileged user polytrain; it owns only /data (the volume) and /app.
# Agents start each rank under bubblewrap as an unprivileged uid of its own in the group of
# polytrain-run (docs/security.md), which needs the agent itself to be root:
# docker-compose.yml runs the agent services with `user: root` and the right to create
# namespaces.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap iptables libjemalloc2 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /app --create-home \
        --shell /usr/sbin/nologin polytrain \
    && useradd --system --uid 10002 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin polytrain-run \
    && install -d -o polytrain -g polytrain -m 0700 /data
# Sources go to /src only to build the wheel (templates, static files, migrations and
# alembic.ini ship inside the package) and are removed: the image runs what was installed.
COPY pyproject.toml setup.py MANIFEST.in README.md alembic.ini /src/
COPY backend /src/backend
COPY worker /src/worker
COPY contracts /src/contracts
COPY polytrain /src/polytrain
COPY frontend /src/frontend
COPY migrations /src/migrations
COPY examples /src/examples
# For a CPU-only image pass your CPU wheel index: --build-arg TORCH_PIP_ARGS="--index-url URL"
ARG TORCH_PIP_ARGS=""
RUN pip install --no-cache-dir torch==2.13.0 ${TORCH_PIP_ARGS} \
    && pip install --no-cache-dir /src && rm -rf /src
WORKDIR /app
ENV POLYTRAIN_DATA_DIR=/data
USER polytrain
EXPOSE 8000
CMD ["polytrain", "api", "--host", "0.0.0.0", "--port", "8000"]
