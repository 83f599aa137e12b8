module tether.io/go

go 1.21
