module sandman/daemon

go 1.22
