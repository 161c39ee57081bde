def main() -> None:
    raise SystemExit("not implemented yet")
