# One image for the API and the agents; the command chooses the role.
FROM python:3.11-slim
# Everything runs as this unprivileged user; it owns only /data (the volume) and /app.
RUN useradd --system --uid 10001 --user-group --home-dir /app --create-home \
        --shell /usr/sbin/nologin polytrain \
    && install -d -o polytrain -g polytrain -m 0700 /data
# Sources go to /src only to build the wheel (templates, static files, migrations and
# alembic.ini ship inside the package) and are removed: the image runs what was installed.
COPY pyproject.toml setup.py MANIFEST.in README.md alembic.ini /src/
COPY backend /src/backend
COPY worker /src/worker
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
