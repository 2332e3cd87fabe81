# The coordinator's container: a release build of starling-coordinator and the built dashboard
# on a slim Debian runtime, running as a non-root user. See README "Container".
# tests/tests/integration/container.rs reads this file and runs the same build and entrypoint against
# Postgres (this machine has no container engine).

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p starling-coordinator

FROM node:20-bookworm-slim AS dashboard
WORKDIR /src/web-dashboard
COPY web-dashboard/package.json web-dashboard/package-lock.json ./
RUN npm ci --no-audit --no-fund
COPY web-dashboard/ ./
RUN npm run build

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/starling --create-home starling
COPY --from=build /src/target/release/starling-coordinator /usr/local/bin/starling-coordinator
COPY --from=dashboard /src/web-dashboard/dist /usr/share/starling/dashboard
USER starling
WORKDIR /var/lib/starling
ENV STARLING_LISTEN=0.0.0.0:8080
ENV STARLING_DASHBOARD_DIR=/usr/share/starling/dashboard
ENV STARLING_LOG_FORMAT=json
# TLS is on: the deployment mounts the certificate and key here (compose.yaml: ./tls).
ENV STARLING_TLS_CERT=/etc/starling/tls/cert.pem
ENV STARLING_TLS_KEY=/etc/starling/tls/key.pem
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=6s --start-period=10s --retries=3 CMD ["starling-coordinator", "healthcheck"]
# STARLING_DATABASE_URL and STARLING_OPERATOR_TOKEN come from the deployment; migrations run at start.
ENTRYPOINT ["starling-coordinator"]
CMD ["serve"]
